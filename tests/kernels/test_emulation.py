"""The CPU emulation itself: refusals before any launch (arguments, grids too large for the device),
the emulator's own SM limit, replay of a schedule by its seed, the deadlock report, and the relaxed
memory mode's rules on litmus kernels (tests/kernels/litmus.cpp)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import kernels_cuda
from kernels_cuda import Config, EmulatedGroup, EmulatedInternodeGroup, InternodeConfig, Schedule
from tests.kernels.cases import payload, quantize, routing, weights
from tests.kernels.runs import Run
from tests.kernels.traps import intranode_stall

EMU = Path(kernels_cuda.__file__).parent / "csrc" / "emu"

pytestmark = pytest.mark.skipif(not kernels_cuda.is_built("cpu"), reason="the CPU emulation is not built here")

R, T, H, K, E = 4, 16, 256, 4, 16
CONFIG = Config(4, 4, 16)


def _group(**kwargs) -> EmulatedGroup:
    return EmulatedGroup(R, CONFIG.buffer_size_hint(R, 4 * H, K), CONFIG, device="cpu", **kwargs)


def _inputs(seed: int = 3):
    print(f"data seed {seed}")
    return (payload("random", R, T, H, torch.bfloat16, seed, device="cpu"),
            routing("random", R, T, E, K, seed, device="cpu"), weights(R, T, K, seed, device="cpu"))


def test_bad_arguments_are_refused_naming_the_argument():
    group = _group()
    xs, topk, ws = _inputs()
    with pytest.raises(ValueError, match="topk_idx must be int64"):
        group.get_dispatch_layout([t.int() for t in topk], E)
    layouts = group.get_dispatch_layout(topk, E)
    bad_idx = [t.int() for t in topk]
    with pytest.raises(ValueError, match=r"rank 0\): topk_idx must be int64, got torch.int32"):
        group.engine.dispatch(range(R), xs, bad_idx, ws, layouts, [None] * R, E, 1, 0, None)
    with pytest.raises(ValueError, match="expert_alignment must be >= 1, got 0"):
        group.dispatch(xs, topk, ws, E, expert_alignment=0)
    quantized = [quantize(x) for x in xs]
    with pytest.raises(ValueError, match="x_scales must be float32"):
        group.dispatch([(q, s.double()) for q, s in quantized], topk, ws, E)
    with pytest.raises(ValueError, match=r"x_scales must be \[num_tokens, hidden / 128\] = \[16, 2\]"):
        group.dispatch([(q, s[:, :1]) for q, s in quantized], topk, ws, E)
    misaligned = [torch.empty(T * H + 1, dtype=torch.bfloat16)[1:].view(T, H).copy_(x) for x in xs]
    with pytest.raises(ValueError, match="x is not 16-byte aligned"):
        group.dispatch(misaligned, topk, ws, E)
    with pytest.raises(ValueError, match="rows of 14 bytes"):
        group.dispatch([x[:, :7] for x in xs], topk, ws, E)
    with pytest.raises(ValueError, match="topk_weights must have topk_idx's shape"):
        group.dispatch(xs, topk, [w[:, :2] for w in ws], E)
    results = group.dispatch(xs, topk, ws, E)
    ys = [r[0] for r in results]
    with pytest.raises(ValueError, match=r"combine \(rank 0\): x must have the \d+ rows the dispatch received"):
        group.combine([y[:-1] for y in ys], [r[4] for r in results])



def test_argument_structs_refuse_naming_the_field_and_keep_their_tensors():
    """A `...Rank` struct is the kernel's own per-rank parameter struct and the tensors its pointers point
    into: a missing tensor, an unknown keyword and a tensor on another device are refused naming the field,
    and the tensors given live as long as the struct (the kernel's struct holds only their data pointers)."""
    ext = kernels_cuda.extension("cpu")
    fields = {"num_tokens_per_rank": torch.arange(R, dtype=torch.int32),
              "num_tokens_per_expert": torch.arange(E, dtype=torch.int32),
              "is_token_in_rank": torch.ones(T, R, dtype=torch.bool),
              "rank_prefix_matrix": torch.arange(R * R, dtype=torch.int32).view(R, R),
              "channel_prefix_matrix": torch.arange(R * 4, dtype=torch.int32).view(R, 4)}
    with pytest.raises(RuntimeError, match="NotifyRank needs tensor 'is_token_in_rank'"):
        ext.NotifyRank(rank=0, num_tokens=T, **{k: v for k, v in fields.items() if k != "is_token_in_rank"})
    with pytest.raises(AttributeError, match="no_such_field"):
        ext.NotifyRank(rank=0, num_tokens=T, no_such_field=1, **fields)
    with pytest.raises(RuntimeError, match="tensor 'rank_prefix_matrix' must be on the CPU"):
        ext.NotifyRank(rank=0, num_tokens=T, **{**fields, "rank_prefix_matrix": torch.empty(R, R, device="meta")})
    args = ext.NotifyRank(rank=0, num_tokens=T, **{k: v.clone() for k, v in fields.items()})  # only it holds them
    assert (args.rank, args.num_tokens, args.publish_counts) == (0, T, True)
    for name, tensor in fields.items():
        assert torch.equal(getattr(args, name), tensor), name
    cached = ext.CachedNotifyRank(rank=1, num_tokens=T, channel_prefix_matrix=fields["channel_prefix_matrix"])
    assert cached.send_head is None

def test_a_grid_larger_than_the_device_is_refused_with_the_numbers():
    group = EmulatedGroup(8, 1 << 20, Config(num_sms=20), device="cpu")
    xs = payload("random", 8, 8, H, torch.bfloat16, 1, device="cpu")
    topk = routing("random", 8, 8, 32, K, 1, device="cpu")
    with pytest.raises(ValueError, match="needs a cooperative grid of 160 blocks, but the device has 132 SMs"):
        group.dispatch(xs, topk, weights(8, 8, K, 1, device="cpu"), 32)
    internode = EmulatedInternodeGroup(2, 2, 1 << 20, 1 << 20, InternodeConfig.for_nodes(2), device="cpu",
                                       schedule=Schedule(sm_count=16))
    with pytest.raises(ValueError, match="but the device has 16 SMs"):
        internode.dispatch(payload("random", 4, 8, H, torch.bfloat16, 1, device="cpu"),
                           routing("random", 4, 8, 16, K, 1, device="cpu"), weights(4, 8, K, 1, device="cpu"), 16)
    config = InternodeConfig(num_sms=2, nvl_chunk=1, nvl_capacity=20, rdma_chunk=2, rdma_capacity=12)
    many = EmulatedInternodeGroup(20, 1, *config.buffer_size_hints(20, 1, 2 * H, K), config, device="cpu")
    with pytest.raises(ValueError, match="20 rank.s. x 1 channels over 20 nodes needs a cooperative grid of 420 "
                                         "blocks, but the device has 132 SMs"):  # the notify: 1 + 20 per rank
        many.dispatch(payload("random", 20, 8, H, torch.bfloat16, 1, device="cpu"),
                      routing("random", 20, 8, 40, K, 1, device="cpu"), weights(20, 8, K, 1, device="cpu"), 40)


def test_the_emulator_enforces_the_sm_limit_itself():
    group = _group(schedule=Schedule(sm_count=12))
    group.engine.sms = 1 << 20  # past the host's check: the emulated launch must refuse on its own
    xs, topk, ws = _inputs()
    with pytest.raises(RuntimeError, match="a cooperative grid of 20 blocks cannot be resident on 12 SMs"):
        group.dispatch(xs, topk, ws, E)


def test_a_seed_replays_a_failing_schedule_exactly():
    """Which roles time out first and in what order is the interleaving's: the same seed gives the same
    report, another seed another one."""
    def report(seed: int) -> str:
        group, launch = intranode_stall(Run("cpu", Schedule("random", seed)))
        with pytest.raises(RuntimeError) as error:
            launch()
        return str(error.value)

    first, again, other = report(5), report(5), report(6)
    assert first == again
    assert first != other
    assert "schedule: random seed=5" in first and "schedule: random seed=6" in other


def test_a_deadlock_reports_every_waiting_role_and_the_blocked_lanes():
    group, launch = intranode_stall(Run("cpu", Schedule("pct", 1)))
    with pytest.raises(RuntimeError) as error:
        launch()
    text = str(error.value)
    assert "deadlock: no fiber could make progress, so every waiting role was timed out" in text, text
    lines = [line.strip() for line in text.splitlines() if "kernels_cuda timeout: role=" in line]
    assert len(lines) == len(set(lines)) > 1  # one line per distinct waiting role and context
    roles = {int(line.split("role=")[1].split()[0]) for line in lines}
    assert roles <= {2, 3} and "blocked:" in text and "(lane 0 trapped)" in text
    assert all("rank=1 " not in line for line in lines)  # the stalled rank itself waits for nobody
    record = group.error_record()
    assert record["code"] == 1 and record["role_name"] in ("DispatchSender", "DispatchReceiver")


def test_a_relaxed_failure_report_names_the_memory_mode_and_replays():
    def report(seed: int) -> str:
        print(f"run: cpu-random-seed{seed}-relaxed")
        group, launch = intranode_stall(Run("cpu", Schedule("random", seed, memory="relaxed")))
        with pytest.raises(RuntimeError) as error:
            launch()
        return str(error.value)

    first, again = report(5), report(5)
    assert first == again and "schedule: random seed=5 memory=relaxed" in first, first
    with pytest.raises(ValueError, match="Schedule.memory must be one of sequential, relaxed, got 'weak'"):
        Schedule(memory="weak")


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the litmus kernels")
def test_litmus_kernels_show_the_relaxed_memory_rules(tmp_path):
    """Block 0 writes data then raises a flag, block 1 waits for the flag and reads the data (litmus.cpp),
    200 seeds each. Sequential memory never shows stale data; relaxed memory does exactly where PTX allows
    it: after a plain flag store, and after a volatile flag store whose thread did not fence after the
    barrier that ordered the data (a fence alone publishes nothing)."""
    exe = tmp_path / "litmus"
    sources = [Path(__file__).with_name("litmus.cpp"), *(EMU / f for f in ("emulator.cpp", "fiber.cpp", "memory.cpp"))]
    subprocess.run(["g++", "-std=c++20", "-O1", "-DEP_CPU_EMULATION", f"-I{EMU}", f"-I{EMU.parent}", *map(str, sources),
                    "-o", str(exe)], check=True, timeout=300)
    output = subprocess.run([str(exe), "200"], capture_output=True, text=True, check=True, timeout=300).stdout
    print(f"litmus seeds 0-199 (even: random, odd: pct), each variant\n{output}")
    stale = {}
    for line in output.splitlines():
        if "stale=" in line:
            writer, memory, *fields = line.split()
            values = dict(f.split("=") for f in fields)
            assert values["failed"] == "0", line  # a flag that stays pending becomes visible eventually
            stale[writer, memory] = int(values["stale"])
    assert len(stale) == 14 and all(n == 0 for (_, memory), n in stale.items() if memory == "sequential"), stale
    caught = {writer for (writer, memory), n in stale.items() if memory == "relaxed" and n > 0}
    assert caught == {"plain_flag", "barrier_volatile"}, stale
    assert "own_misses=0" in output and "replay identical=1" in output, output
