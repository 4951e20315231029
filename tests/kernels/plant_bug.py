"""Show that the kernel tests have teeth: plant a known bug in a scratch copy of the repository, build
the CPU emulation there, run the kernel tests against it and report which tests catch it, under which
schedules and seeds (each failing test's id names them; its error replays with the same seed).

Usage: python -m tests.kernels.plant_bug [NAME ...] [-k EXPR] [--asan]
  NAME   bugs from BUGS (default: all); -k selects tests as pytest's -k does;
  --asan builds and runs under AddressSanitizer (out-of-bounds writes then fail at once).
The repository itself is not touched. Results of a run are kept in docs/kernels_emulation.md.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = "kernels_cuda/csrc/kernels"


@dataclass(frozen=True)
class Bug:
    path: str
    original: str  # must occur exactly once
    planted: str
    what: str


BUGS = {
    "row_too_far": Bug(
        f"{KERNELS}/intranode_dispatch.cu",
        "int4* dst = static_cast<int4*>(a.recv_x) + static_cast<int64_t>(row) * p.hidden_int4;",
        "int4* dst = static_cast<int4*>(a.recv_x) + static_cast<int64_t>(row + 1) * p.hidden_int4;",
        "the intranode receiver writes each row's payload one row too far"),
    "skip_room_wait": Bug(
        f"{KERNELS}/intranode_dispatch.cu",
        "if (lane_id() == 0) head = wait_for_room<S>(head_word, tail, layout.capacity, p.chunk, head, ctx);",
        "if (lane_id() == 0) head = tail + p.chunk - layout.capacity;",
        "the intranode dispatch sender skips the ring-room wait (assumes the consumer keeps up)"),
    "diverged_bar_sync": Bug(
        f"{KERNELS}/intranode_dispatch.cu",
        "        __syncwarp();  // bar.sync is aligned: the leader's warp reconverges after its spin first\n",
        "",
        "the intranode dispatch receiver reaches bar.sync while its leader lane still spins (the reviewed defect)"),
    "early_slot_release": Bug(
        f"{KERNELS}/intranode_combine.cu",
        "        __syncwarp();\n        __threadfence_block();",
        "        __threadfence_block();",
        "a combine reducer lane releases a ring slot while other lanes may still read it (found by the emulation)"),
    "rdma_tail_before_data": Bug(
        f"{KERNELS}/internode_dispatch.cu",
        "            rdma.signal_add_warp(m, rl.word(rl.tail, c, me), count);\n            if (lane == m) issued += count;",
        "            if (lane == m) issued += count;",
        "the internode RDMA coordinator never publishes the tail of the records it put"),
    "node_mask_16_bits": Bug(
        f"{KERNELS}/internode_dispatch.cu",
        "const unsigned nodes = __ballot_sync(0xffffffffu, mask != 0);",
        "const unsigned nodes = __ballot_sync(0xffffffffu, mask != 0) & 0xffffu;",
        "the internode RDMA senders keep a token's destination nodes in a 16-bit mask: its records for nodes 16 "
        "to 19 are counted but never written"),
    # Memory-ordering bugs: a GPU may show them, the sequentially consistent emulation cannot; the runs in
    # the relaxed memory mode (Schedule.memory, `-relaxed` in a test id) catch them.
    "released_without_fence": Bug(
        f"{KERNELS}/internode_dispatch.cu",
        "                __threadfence_block();\n                st_volatile(released + lane, slot);",
        "                st_volatile(released + lane, slot);",
        "the internode RDMA senders' round hands its records to the coordinator (a volatile store to shared "
        "memory) without the fence that makes it a release: the other sender warps' records are not ordered "
        "before it, so the coordinator may put and signal records it cannot see yet"),
    "plain_tail_publish": Bug(
        f"{KERNELS}/intranode_dispatch.cu",
        "        if (leader) net.signal_store(dst, layout.word(layout.tail, channel, me), tail);",
        "        if (leader) st_plain(net.template peer_ptr<int>(dst, layout.word(layout.tail, channel, me)), tail);",
        "the intranode dispatch sender publishes the ring tail with a plain store instead of a release: the "
        "receiver may see the tail before the records it covers"),
}


def copy_tree(dest: Path) -> None:
    """The repository's tracked and untracked-but-not-ignored files, as git lists them."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def plant(tree: Path, bug: Bug) -> None:
    path = tree / bug.path
    text = path.read_text()
    if text.count(bug.original) != 1:
        raise SystemExit(f"plant_bug: the text to replace occurs {text.count(bug.original)} times in {bug.path}")
    path.write_text(text.replace(bug.original, bug.planted))


def asan_preload() -> str:
    """LD_PRELOAD for an --asan build: ASan's runtime, and libstdc++ (else ASan's __cxa_throw fails)."""
    names = ("libasan.so", "libstdc++.so")
    return " ".join(subprocess.run(["g++", f"-print-file-name={n}"], capture_output=True, text=True).stdout.strip()
                    for n in names)


@dataclass
class Result:
    ran: int
    failed: list[str]  # test ids (they name the schedule and seed); a test that crashed the process ends it
    seconds: float
    output: str        # pytest's (and, under --asan, AddressSanitizer's) output


_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR) (tests/\S+::\S+)")  # pytest -rA's summary lines


def run_kernel_tests(bug: Bug | None, select: str | None, asan: bool) -> Result:
    """The kernel tests against a scratch copy of the repository with `bug` planted (None: as it is)."""
    with tempfile.TemporaryDirectory(prefix="plant_bug_") as scratch:
        tree = Path(scratch)
        copy_tree(tree)
        if bug is not None:
            plant(tree, bug)
        env = dict(os.environ, PYTHONPATH=str(tree))
        build = [sys.executable, "-m", "kernels_cuda.build", "--device", "cpu", *(["--asan"] if asan else [])]
        subprocess.run(build, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
        if asan:
            env.update(LD_PRELOAD=asan_preload(), ASAN_OPTIONS="detect_leaks=0:halt_on_error=1")
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "tests/kernels", "-v", "-rA", "-p", "no:cacheprovider",
                               "--ignore=tests/kernels/test_procedures.py",  # (it plants bugs itself)
                               *(["-s"] if asan else []), *(["-k", select] if select else [])],
                              cwd=tree, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    ran, failed = 0, []
    for line in proc.stdout.splitlines():
        match = _OUTCOME.match(line)
        if match:
            ran += 1
            if match.group(1) != "PASSED":
                failed.append(match.group(2).split("/")[-1])
    if proc.returncode not in (0, 1) or "ERROR: AddressSanitizer" in output:  # the process died (a crash or ASan)
        started = [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("tests/") and "::" in line]
        failed.append(f"{started[-1].split('/')[-1] if started else '(collection)'}: the process died "
                      f"(exit {proc.returncode})")
        ran += 1
    return Result(ran, failed, seconds, output)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("bugs", nargs="*", metavar="NAME", help=f"one of {', '.join(BUGS)} (default: all)")
    parser.add_argument("-k", dest="select", default=None, help="pytest -k expression for the tests to run")
    parser.add_argument("--asan", action="store_true", help="build and run under AddressSanitizer")
    args = parser.parse_args(argv)
    unknown = [name for name in args.bugs if name not in BUGS]
    if unknown:
        parser.error(f"unknown bug {', '.join(unknown)}; choose from {', '.join(BUGS)}")
    caught_all = True
    for name in args.bugs or list(BUGS):
        result = run_kernel_tests(BUGS[name], args.select, args.asan)
        caught_all &= bool(result.failed)
        print(f"{name}: {BUGS[name].what}\n  {len(result.failed)} of {result.ran} kernel tests failed "
              f"({result.seconds:.0f} s)")
        for test in result.failed[:12]:
            print(f"    {test}")
        if len(result.failed) > 12:
            print(f"    ... and {len(result.failed) - 12} more")
        sanitizer = next((line for line in result.output.splitlines() if "ERROR: AddressSanitizer" in line), None)
        if sanitizer:
            print(f"    {sanitizer.strip()}")
        elif result.ran == 0:
            print("    " + "\n    ".join(result.output.strip().splitlines()[-8:]))
    return 0 if caught_all else 1


if __name__ == "__main__":
    sys.exit(main())
