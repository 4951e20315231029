"""Overlapped FB pairs: the scheduler's collective order and failure handling, and bitwise-equal
DualPipeV training with and without overlap (pp 2, ep 2 over 2 simulated nodes, gloo)."""
import pytest
import torch

from moe_train.train import Trainer
from parallel.dispatch.comm import ProcessGroupComm
from parallel.dispatch.handles import OverlapSwitch
from parallel.mixed_precision import current_grad
from parallel.pipeline.overlap import FBOverlap
from parallel.topology import build_topology
from tests.distributed.pool import WorkerError
from tests.distributed.test_training import corpus_cache, tiny_config  # noqa: F401 - corpus_cache is a fixture


def chunk(comm: ProcessGroupComm, tag: float, steps: int, log: list):
    """A stand-in chunk: `steps` all-to-alls of rows tagged (tag, step, source rank)."""
    def run() -> None:
        for step in range(steps):
            log.append((tag, step, "compute"))
            rows = torch.tensor([[tag, step, comm.rank]] * comm.size)
            got = comm.all_to_all(rows, [1] * comm.size, [1] * comm.size)
            assert got.tolist() == [[tag, step, peer] for peer in range(comm.size)]
    return run


def interleaved_pair(fail: bool) -> tuple[list, int, int]:
    import torch.distributed as dist

    switch = OverlapSwitch()
    comm, log, hook = ProcessGroupComm(dist.group.WORLD, switch), [], FBOverlap(switch)

    def failing() -> None:
        chunk(comm, 2.0, 1, log)()
        raise ValueError("backward chunk failed")

    hook(chunk(comm, 1.0, 3, log), failing if fail else chunk(comm, 2.0, 1, log))
    return log, hook.stats.collectives, hook.stats.hidden


def test_pair_interleaves_at_collectives(pools):
    results = pools.get(2).run(interleaved_pair, False, deadline_s=60)
    log, collectives, hidden = results[0]
    assert all(r == results[0] for r in results)
    # The chunks alternate at every collective; the forward's last one runs alone: nothing hides it.
    assert [entry[:2] for entry in log] == [(1.0, 0), (2.0, 0), (1.0, 1), (1.0, 2)]
    assert (collectives, hidden) == (4, 3)


def test_failure_in_one_chunk_ends_the_pair(pools):
    with pytest.raises(WorkerError, match="backward chunk failed"):
        pools.get(2).run(interleaved_pair, True, deadline_s=60)


def train_both_ways(cache_dir: str, run_dir: str, steps: int, schedule: str) -> dict:
    import torch.distributed as dist

    out = {}
    for overlap in (False, True):
        topology = build_topology(pp=2, ep=2, gpus_per_node=1, timeout_s=60)
        trainer = None
        try:
            config = tiny_config(cache_dir, f"{run_dir}_{overlap}", "train.seq_length=16", "train.global_batch_size=16",
                                 "parallel.pp=2", "parallel.ep=2", f"parallel.schedule={schedule}",
                                 "parallel.dispatcher=hierarchical", f"parallel.overlap={str(overlap).lower()}")
            trainer = Trainer(config, topology)
            losses, grads = [], []
            for _ in range(steps):
                losses.append({k: float(v) for k, v in trainer.compute_gradients().items()})
                grads.append({n: current_grad(p).clone() for n, p in trainer.model.named_parameters()})
                trainer.apply_update()
            hook = trainer.pipeline.runtime.fb_overlap
            out[overlap] = {"losses": losses, "grads": grads,
                            "stats": None if hook is None else (hook.stats.pairs, hook.stats.hidden)}
        finally:
            if trainer is not None:
                trainer.pipeline.destroy()
            topology.destroy_groups()
            dist.barrier()
    return out


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_dualpipe_overlap_is_bitwise_equal(pools, corpus_cache, tmp_path, schedule):  # noqa: F811
    results = pools.get(4).run(train_both_ways, corpus_cache, str(tmp_path / "run"), 2, schedule, deadline_s=300)
    for rank, result in enumerate(results):
        plain, overlapped = result[False], result[True]
        pairs, hidden = overlapped["stats"]
        assert pairs > 0 and hidden > 0, rank
        assert overlapped["losses"] == plain["losses"], rank
        for got, want in zip(overlapped["grads"], plain["grads"]):
            assert got.keys() == want.keys() and any(grad.any() for grad in want.values())
            for name in want:
                assert torch.equal(got[name], want[name]), (rank, name)
