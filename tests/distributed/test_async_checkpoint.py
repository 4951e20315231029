"""checkpoint.async_save on 2 gloo processes (dp 2 x ep 2, ZeRO-1): the background saves of both ranks are
published as the synchronous ones, with one rank's tensor writes slowed down and the end of its write
seen later than on the other rank."""
import concurrent.futures
import contextlib
import json
import threading
from pathlib import Path
from unittest import mock

import torch
import torch.distributed.checkpoint as dcp

from moe_train.checkpoint.dcp import iteration_dir, latest_iteration, list_iterations
from moe_train.train import Trainer
from parallel.flat_range import FlatRange
from parallel.sharded_state import model_state, optimizer_state
from parallel.topology import build_topology
from tests.distributed.test_training import corpus_cache, tiny_config  # noqa: F401 - corpus_cache is a fixture
from tests.unit._checkpoint_writer import slowed_write


def seen_late(delay_s: float):
    """`dcp.async_save` whose future completes `delay_s` after the write has finished."""
    async_save = dcp.async_save

    def late(*args, **kwargs) -> concurrent.futures.Future:
        written, seen = async_save(*args, **kwargs), concurrent.futures.Future()

        def forward(done: concurrent.futures.Future) -> None:
            error = done.exception()
            threading.Timer(delay_s, seen.set_exception if error else seen.set_result,
                            (error if error else done.result(),)).start()

        written.add_done_callback(forward)
        return seen

    return late


def train_and_save(async_save: bool, slow_rank: int, cache_dir: str, run_dir: str) -> int:
    """`Trainer.train` for 8 steps saving every 4; rank `slow_rank`'s tensor writes start 0.3 s late and it sees
    their end 1.5 s after the other rank (several steps: publishing must wait for every rank). Returns the
    exit status."""
    import torch.distributed as dist

    topology = build_topology(pp=1, ep=2, gpus_per_node=1, timeout_s=60)
    slow = contextlib.ExitStack()
    if dist.get_rank() == slow_rank:
        slow.enter_context(mock.patch.object(dcp.FileSystemWriter, "write_data", slowed_write(0.3)))
        slow.enter_context(mock.patch.object(dcp, "async_save", seen_late(1.5)))
    try:
        with slow:
            config = tiny_config(cache_dir, run_dir, "parallel.ep=2", "parallel.zero1=true", "train.steps=8",
                                 "train.log_interval=1", "checkpoint.interval=4",
                                 f"checkpoint.async_save={str(async_save).lower()}")
            return Trainer(config, topology).train()
    finally:
        topology.destroy_groups()
        dist.barrier()


def loaded(cache_dir: str, run_dir: Path, path: Path) -> dict[str, torch.Tensor]:
    """The model and optimizer state of checkpoint `path` loaded into one process, by checkpoint key."""
    trainer = Trainer(tiny_config(cache_dir, str(run_dir), "train.steps=8", f"checkpoint.resume={path}"))
    state = {**model_state(trainer.model), **optimizer_state(trainer.model, trainer.optimizer)}
    return {key: (tensor.values if isinstance(tensor, FlatRange) else tensor).clone() for key, tensor in state.items()}


def test_background_saves_of_two_ranks_equal_synchronous_saves(pools, corpus_cache, tmp_path):
    runs = {mode: tmp_path / mode for mode in ("sync", "async")}
    for mode, run_dir in runs.items():
        assert pools.get(2).run(train_and_save, mode == "async", 1, corpus_cache, str(run_dir),
                                deadline_s=300) == [0, 0], mode
    losses = {mode: [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
              for mode, run_dir in runs.items()}
    assert len(losses["async"]) == 8 and losses["async"] == losses["sync"]
    root = runs["async"] / "checkpoints"
    assert latest_iteration(root) == 8 and list_iterations(root) == [4, 8] and not list(root.glob("*.tmp"))
    for step in (4, 8):
        folder = iteration_dir(root, step)
        assert {p.name for p in folder.glob("rng_rank*.pt")} == {"rng_rank0.pt", "rng_rank1.pt"}
        written = loaded(corpus_cache, tmp_path / f"load_async{step}", folder)
        expected = loaded(corpus_cache, tmp_path / f"load_sync{step}",
                          iteration_dir(runs["sync"] / "checkpoints", step))
        assert written.keys() == expected.keys() and len(written) > 50
        assert all(torch.equal(written[key], expected[key]) for key in expected), step
