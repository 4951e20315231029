"""The straggler report (logging.straggler_threshold) on 2 gloo processes: every forward sleeps BASE_S and
one rank's SLOW_S more, inside the compute phase. The log on rank 0 names that rank and its host (each
rank's host name is faked as host-<rank>), on dp 2 (its peer waits in the loss all-reduce, outside the
compute phase) and on ep 2 (its peer waits in the first MoE all-to-all, inside the forward, which the
compute time leaves out); with equal ranks nobody is named. The runs use tiny.yaml's train.seed; no seed
is drawn."""
import contextlib
import io
import json
import time
from unittest import mock

import pytest

from model.transformer import DeepSeekV3
from moe_train.train import Trainer
from parallel.topology import build_topology
from tests.distributed.test_training import corpus_cache, tiny_config  # noqa: F401 - corpus_cache is a fixture

BASE_S = 0.4  # every forward: keeps the ranks' compute times close to the sleeps on a loaded machine
SLOW_S = 1.0  # the slow rank's extra per forward (one micro-batch per rank and step)
STEPS = 2


def train_with_slow_rank(slow_rank: int | None, ep: int, cache_dir: str, run_dir: str) -> str:
    """`Trainer.train` for STEPS steps, logging once at the end, with rank `slow_rank` (None: none) slowed
    down; returns what the rank printed."""
    import torch.distributed as dist

    rank = dist.get_rank()
    delay = BASE_S + (SLOW_S if rank == slow_rank else 0.0)
    forward = DeepSeekV3.forward

    def slowed(self, *args, **kwargs):
        time.sleep(delay)
        return forward(self, *args, **kwargs)

    topology = build_topology(pp=1, ep=ep, gpus_per_node=2, timeout_s=60)
    printed = io.StringIO()
    try:
        with mock.patch.object(DeepSeekV3, "forward", slowed), \
                mock.patch("socket.gethostname", return_value=f"host-{rank}"), contextlib.redirect_stdout(printed):
            config = tiny_config(cache_dir, run_dir, f"parallel.ep={ep}", f"train.steps={STEPS}",
                                 f"train.log_interval={STEPS}", "train.global_batch_size=2", "train.micro_batch_size=1")
            assert Trainer(config, topology).train() == 0
        return printed.getvalue()
    finally:
        topology.destroy_groups()
        dist.barrier()


def straggler_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("straggler")]


@pytest.mark.parametrize("ep, slow_rank", [(1, 1), (2, 0)], ids=["dp2-rank1-slow", "ep2-rank0-slow"])
def test_the_log_names_the_slowed_rank_and_its_host(pools, corpus_cache, tmp_path, ep, slow_rank):
    run_dir = tmp_path / "run"
    printed = pools.get(2).run(train_with_slow_rank, slow_rank, ep, corpus_cache, str(run_dir), deadline_s=240)
    lines = straggler_lines(printed[0])
    assert len(lines) == 1, printed[0]
    assert lines[0].startswith(f"straggler at step {STEPS}: rank {slow_rank} on host-{slow_rank} computes "), lines
    assert "of the 2 ranks of pipeline stage 0" in lines[0] and "logging.straggler_threshold=0.2)" in lines[0]
    assert not straggler_lines(printed[1])  # only the logging rank reports
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    fast = 1 - slow_rank
    slow_s, fast_s = record[f"ranks/{slow_rank}/compute_s"], record[f"ranks/{fast}/compute_s"]
    assert slow_s >= BASE_S + SLOW_S, record  # the sleeps are inside the compute phase
    # the fast rank waited for the slow one each step, but not inside its compute time
    assert record[f"ranks/{fast}/step_s"] - fast_s > 0.8 * SLOW_S, record
    assert f"{slow_s / ((slow_s + fast_s) / 2):.2f}x the median {(slow_s + fast_s) / 2:.3f} s" in lines[0]


def test_equal_ranks_are_not_named(pools, corpus_cache, tmp_path):
    run_dir = tmp_path / "run"
    printed = pools.get(2).run(train_with_slow_rank, None, 2, corpus_cache, str(run_dir), deadline_s=240)
    assert not straggler_lines(printed[0]) and not straggler_lines(printed[1]), printed[0]
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert {key for key in record if key.startswith("ranks/")} == {
        f"ranks/{rank}/{figure}" for rank in (0, 1) for figure in ("step_s", "compute_s")}
    assert all(record[f"ranks/{rank}/compute_s"] >= BASE_S for rank in (0, 1)), record
