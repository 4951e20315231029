"""The agreed stop over 4 gloo processes (moe_train.launch.stop, moe_train.launch.torchrun).

In process: ranks signalled after different steps all stop after the step that carries the first
vote, and save it together. Through the launcher (`scripts/pretrain_dsv3.sh`, dp 4 x ep 4 on two
simulated nodes): SIGTERM, SIGUSR1 or SIGINT to the launcher only, or to one worker only, at a random
moment of the run. Each run must exit 0 within its time limit (else it is reported as a deadlock),
leave one checkpoint that every rank wrote, and resume to the same losses, bit for bit, as an
uninterrupted run.

The suite runs one launcher run per variant; MOE_TRAIN_SIGNAL_SOAK=N runs N per variant and prints
the counts (`MOE_TRAIN_SIGNAL_SOAK=50 pytest tests/distributed/test_signal_stop.py -k soak -s`).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from moe_train.checkpoint.dcp import CheckpointError, iteration_dir, latest_iteration, list_iterations
from moe_train.launch.torchrun import catches, child_pids
from moe_train.train import Trainer
from parallel.topology import build_topology
from tests.distributed.test_training import corpus_cache, tiny_config  # noqa: F401 - corpus_cache is a fixture
from tests.unit.test_stop import signal_after_step

ROOT = Path(__file__).resolve().parents[2]
WORLD = 4
STEPS = 16
RUN_LIMIT_S = 240  # a run still going after this long is a deadlock: the collectives time out after 60 s
JITTER_S = 0.5  # the signal comes up to this long after the chosen step was logged (about 2 steps here)
SOAK = int(os.environ.get("MOE_TRAIN_SIGNAL_SOAK", "0"))
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def train_signalled_after(pp: int, ep: int, steps_by_rank: list[int | None], cache_dir: str,
                          run_dir: str) -> tuple[int, int | None]:
    """Train with rank r signalling itself after step steps_by_rank[r] (None: never); returns the step
    it stopped after and the latest checkpoint."""
    import torch.distributed as dist

    topology = build_topology(pp=pp, ep=ep, gpus_per_node=2, timeout_s=60)
    trainer = None
    try:
        trainer = Trainer(tiny_config(cache_dir, run_dir, f"parallel.pp={pp}", f"parallel.ep={ep}", "train.steps=8",
                                      "checkpoint.interval=0", "train.log_interval=1"), topology)
        mine = steps_by_rank[dist.get_rank()]
        if mine is not None:
            signal_after_step(trainer, mine, signal.SIGTERM)
        with trainer.stop.handling_signals():
            assert trainer.train() == 0
        return trainer.step, latest_iteration(trainer.cfg.checkpoint_dir)
    finally:
        if trainer is not None and trainer.pipeline is not None:
            trainer.pipeline.destroy()
        topology.destroy_groups()
        dist.barrier()


@pytest.mark.parametrize("pp, ep", [(1, 4), (2, 2)], ids=["dp4-ep4", "pp2-dp2-ep2"])
def test_ranks_signalled_after_different_steps_stop_after_the_same_step(pools, corpus_cache, tmp_path, pp, ep):
    """The vote rides along the loss all-reduce: over dp with pp 1, over every stage with pp 2."""
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    r = random.Random(seed)
    steps_by_rank = [r.choice([None, *range(1, 7)]) for _ in range(WORLD)]
    steps_by_rank[r.randrange(WORLD)] = r.randrange(1, 7)  # at least one rank is signalled
    print(f"signalled after steps {steps_by_rank}")
    results = pools.get(WORLD).run(train_signalled_after, pp, ep, steps_by_rank, corpus_cache, str(tmp_path / "run"),
                                   deadline_s=300)
    first = min(s for s in steps_by_rank if s is not None)
    assert results == [(first + 1, first + 1)] * WORLD  # the vote is cast in the step after the signal


@dataclass
class Outcome:
    """How one signalled run ended."""
    label: str
    returncode: int | None  # None: still running at the time limit after the signal (a deadlock), then killed
    saved: int | None  # the latest checkpoint's step
    problems: list[str]
    seconds: float


def launcher(run_dir: Path, cache_dir: str, log: Path) -> subprocess.Popen:
    """scripts/pretrain_dsv3.sh with 4 processes: dp 4 x ep 4 on two simulated nodes, no periodic
    checkpoint (only the stop, or the end, saves)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MOE_TRAIN_ROOT": str(ROOT), "PYTHON": sys.executable,
           "NPROC_PER_NODE": str(WORLD), "OMP_NUM_THREADS": "1"}
    env.pop("SLURM_JOB_ID", None)
    args = ["bash", "scripts/pretrain_dsv3.sh", "moe_train/configs/tiny.yaml"]
    for kv in (f"logging.dir={run_dir}", f"data.cache_dir={cache_dir}", "data.demo_max_bytes=300000",
               "logging.tensorboard=false", f"parallel.ep={WORLD}", "parallel.gpus_per_node=2",
               "parallel.timeout_s=60", "train.threads=1", "train.micro_batch_size=2", f"train.steps={STEPS}",
               "train.log_interval=1", "checkpoint.interval=0"):
        args += ["--set", kv]
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def end_or_kill(proc: subprocess.Popen, deadline: float) -> int | None:
    """The launcher's exit status, or None after killing it and its workers at the deadline."""
    try:
        return proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for pid in child_pids(proc.pid):  # each worker leads a session of its own
            os.killpg(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def wait_for_step(proc: subprocess.Popen, log: Path, run_dir: Path, step: int, deadline: float) -> bool:
    """Whether the run has logged `step` (0: every worker is training; rank 0 says so once all have
    started) before the deadline, or has ended."""
    while time.monotonic() < deadline and proc.poll() is None:
        if logged_steps(run_dir) >= step and "training " in log.read_text():
            return True
        time.sleep(0.02)
    return proc.poll() is not None


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoint_problems(run_dir: Path) -> list[str]:
    """What is wrong with the run's checkpoints: one complete checkpoint with every rank's files is expected."""
    root = run_dir / "checkpoints"
    try:
        step = latest_iteration(root)
    except CheckpointError as err:
        return [str(err)]
    if step is None or list_iterations(root) != [step]:
        return [f"checkpoints {list_iterations(root)}, latest {step}"]
    folder = iteration_dir(root, step)
    files = {p.name for p in folder.iterdir()}
    missing = ({f"__{r}_0.distcp" for r in range(WORLD)} | {f"rng_rank{r}.pt" for r in range(WORLD)}) - files
    leftovers = [p.name for p in root.iterdir() if p.name.endswith(".tmp")]
    return [f"{folder} lacks {sorted(missing)}"] * bool(missing) + [f"left {leftovers}"] * bool(leftovers)


def send(proc: subprocess.Popen, target: str, signum: int, r: random.Random) -> str:
    """Signal the launcher, or one of its workers drawn from `r`; says whom, for the label."""
    ended = " (the run had ended first)"
    workers = child_pids(proc.pid)
    if target == "worker" and not workers:
        return ended
    victim = proc.pid if target == "launcher" else r.choice(workers)
    try:
        os.kill(victim, signum)
    except ProcessLookupError:
        return ended
    return "" if target == "launcher" else f" to worker {workers.index(victim)} of {len(workers)}"


def resume_problems(run: Path, cache_dir: str, log: Path, out: str) -> list[str]:
    """Resume a run that stopped before the end; what went wrong (the losses are compared afterwards)."""
    saved = latest_iteration(run / "checkpoints")
    if f"saved {iteration_dir(run / 'checkpoints', saved)}, exiting" not in out:
        return ["no stop line naming the checkpoint"]
    resumed = end_or_kill(launcher(run, cache_dir, log), time.monotonic() + RUN_LIMIT_S)
    if resumed != 0 or "Traceback" in log.read_text():
        return [f"resume: exit {resumed}", log.read_text()[-3000:]]
    return []


def signal_one_run(target: str, seed: int, cache_dir: str, base: Path, reference: list[float]) -> Outcome:
    """One run: start it, signal the launcher or one worker at a random moment (a random step from
    the start of training to the end, plus up to JITTER_S), check the exit, the checkpoint and the
    output, resume it if it stopped early, and compare every loss with the uninterrupted run's."""
    r = random.Random(seed)
    signum, step, jitter = r.choice(SIGNALS), r.randint(0, STEPS), r.uniform(0.0, JITTER_S)
    run, log = base / f"{target}-{seed}", base / f"{target}-{seed}.log"
    label = f"{target} {signal.Signals(signum).name} {jitter:.2f} s after step {step} (seed {seed})"
    start = time.monotonic()
    proc = launcher(run, cache_dir, log)
    if not wait_for_step(proc, log, run, step, start + RUN_LIMIT_S):
        killed = end_or_kill(proc, time.monotonic())
        return Outcome(label, killed, None, ["hung before the signal", log.read_text()[-2000:]],
                       time.monotonic() - start)
    time.sleep(jitter)
    label += send(proc, target, signum, r)
    returncode = end_or_kill(proc, start + RUN_LIMIT_S)
    out = log.read_text()
    problems = [] if returncode == 0 else [f"exit {returncode}" if returncode is not None else "deadlock"]
    problems += ["a traceback in the output"] * ("Traceback" in out) + checkpoint_problems(run)
    saved = latest_iteration(run / "checkpoints") if not problems else None
    if saved is not None and saved < STEPS:
        problems += resume_problems(run, cache_dir, base / f"{target}-{seed}.resume.log", out)
    if not problems and losses(run) != reference:
        problems.append(f"losses differ from the uninterrupted run: {losses(run)} vs {reference}")
    if problems:
        problems.append(out[-3000:])
    return Outcome(label, returncode, saved, problems, time.monotonic() - start)


def wait_for_workers_starting_up(proc: subprocess.Popen, log: Path, deadline: float) -> list[int]:
    """The workers once all of them note stop signals (moe_train.launch.worker's first act) while none has
    started training yet (the trainer's imports and set-up: seconds); [] if the moment was missed."""
    while time.monotonic() < deadline and proc.poll() is None:
        workers = child_pids(proc.pid)
        if "training " in log.read_text():
            return []
        if len(workers) == WORLD and all(catches(pid, (signal.SIGTERM, signal.SIGUSR1)) for pid in workers):
            return workers
        time.sleep(0.01)
    return []


@pytest.mark.slow
@pytest.mark.parametrize("target", ["launcher", "worker"])
def test_a_signal_while_the_workers_start_up_stops_after_their_first_step(corpus_cache, uninterrupted, tmp_path,
                                                                         target):
    """SIGUSR1 while the workers import torch and build the model: the signal is kept (to a worker: by the
    worker's entry point; to the launcher: held until the workers note signals), every rank saves step 1
    and exits 0, and the resumed run has the uninterrupted losses. Workers that ran moe_train.train
    directly ended by the signal, and torchrun then stopped the others (exit 1, nothing saved)."""
    run, log = tmp_path / "run", tmp_path / "run.log"
    proc = launcher(run, corpus_cache, log)
    workers = wait_for_workers_starting_up(proc, log, time.monotonic() + RUN_LIMIT_S)
    if not workers:
        end_or_kill(proc, time.monotonic())
        pytest.fail("the workers' start-up was missed: " + log.read_text()[-2000:])
    victim = proc.pid if target == "launcher" else random.Random(len(workers)).choice(workers)
    os.kill(victim, signal.SIGUSR1)
    returncode = end_or_kill(proc, time.monotonic() + RUN_LIMIT_S)
    out = log.read_text()
    assert returncode == 0 and "Traceback" not in out, out[-3000:]
    assert not checkpoint_problems(run) and latest_iteration(run / "checkpoints") == 1, out[-3000:]
    assert not resume_problems(run, corpus_cache, tmp_path / "resume.log", out)
    assert losses(run) == uninterrupted


@pytest.fixture(scope="module")
def uninterrupted(corpus_cache, tmp_path_factory) -> list[float]:
    """The losses of the run that nothing interrupts."""
    base = tmp_path_factory.mktemp("uninterrupted")
    proc = launcher(base / "run", corpus_cache, base / "run.log")
    assert end_or_kill(proc, time.monotonic() + RUN_LIMIT_S) == 0, (base / "run.log").read_text()[-3000:]
    reference = losses(base / "run")
    assert len(reference) == STEPS
    return reference


@pytest.mark.slow
@pytest.mark.parametrize("target", ["launcher", "worker"])
def test_a_signal_at_a_random_moment_saves_one_step_exits_0_and_resumes_bit_exact(corpus_cache, uninterrupted,
                                                                                 tmp_path, target):
    seed = random.randrange(2**32)
    outcome = signal_one_run(target, seed, corpus_cache, tmp_path, uninterrupted)
    print(f"{outcome.label}: exit {outcome.returncode}, saved step {outcome.saved}, {outcome.seconds:.0f} s")
    assert not outcome.problems, "\n".join([outcome.label, *outcome.problems])


@pytest.mark.skipif(SOAK == 0, reason="set MOE_TRAIN_SIGNAL_SOAK=N to run N signalled runs per variant")
@pytest.mark.parametrize("target", ["launcher", "worker"])
def test_soak(corpus_cache, uninterrupted, tmp_path, target):
    """N runs of the test above per variant; every outcome is printed, the failures listed at the end."""
    seeds = random.Random(random.randrange(2**32)).sample(range(2**32), SOAK)
    start, failed, deadlocks = time.monotonic(), [], 0
    for i, seed in enumerate(seeds):
        outcome = signal_one_run(target, seed, corpus_cache, tmp_path, uninterrupted)
        status = "ok" if not outcome.problems else "FAILED: " + outcome.problems[0]
        print(f"[{i + 1}/{SOAK}] {outcome.label}: exit {outcome.returncode}, saved step {outcome.saved}, "
              f"{outcome.seconds:.0f} s, {status}", flush=True)
        failed += [outcome] * bool(outcome.problems)
        deadlocks += outcome.returncode is None
    print(f"{target}: {SOAK} runs, {SOAK - len(failed)} ok, {len(failed)} failed, {deadlocks} deadlocks, "
          f"{time.monotonic() - start:.0f} s", flush=True)
    assert not failed, "\n\n".join("\n".join([o.label, *o.problems]) for o in failed)
