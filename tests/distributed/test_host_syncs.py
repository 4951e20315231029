"""The host-sync budget of a training step: the tiny config on EP 2 x PP 2 (4 gloo processes).

Each rank counts the syncs of its second step (`tests.host_syncs`); the only ones left are the
split sizes of the MoE all-to-alls, one per hop per MoE layer forward: stage 0 holds one MoE
layer, stage 1 two and the MTP layer, and each runs the dp replica's one micro-batch (global batch
8 = micro-batch 4 x dp 2). Backward passes reuse the forward's splits.
"""
import pytest

from tests.host_syncs import HostSyncCounter
from moe_train.train import Trainer
from parallel.topology import build_topology
from tests.distributed.test_training import corpus_cache, tiny_config  # noqa: F401 - corpus_cache is a fixture


def step_syncs(gpus_per_node: int, dispatcher: str, cache_dir: str, run_dir: str) -> list[tuple[str, str]]:
    import torch.distributed as dist

    topology = build_topology(pp=2, ep=2, gpus_per_node=gpus_per_node, timeout_s=60)
    trainer = None
    try:
        # the tiny config's own batch: global 8, micro-batch 4
        config = tiny_config(cache_dir, f"{run_dir}{dist.get_rank()}", "parallel.pp=2", "parallel.ep=2",
                             f"parallel.dispatcher={dispatcher}", "train.micro_batch_size=4")
        trainer = Trainer(config, topology)
        trainer.train_step()
        with HostSyncCounter() as counter:
            trainer.train_step()
        return [(s.kind, s.where.split(":")[0]) for s in counter.syncs]
    finally:
        if trainer is not None:
            trainer.pipeline.destroy()
        topology.destroy_groups()
        dist.barrier()


@pytest.mark.parametrize("gpus_per_node, dispatcher, hops", [(2, "alltoall", 1), (1, "hierarchical", 2)])
def test_ep2_pp2_step_syncs_once_per_all_to_all_hop(pools, corpus_cache, tmp_path, gpus_per_node, dispatcher,  # noqa: F811
                                                    hops):
    results = pools.get(4).run(step_syncs, gpus_per_node, dispatcher, corpus_cache, str(tmp_path / "run"), deadline_s=180)
    moe_layers = [1, 1, 3, 3]  # ranks 0, 1: stage 0; ranks 2, 3: stage 1 (with MTP)
    for rank, syncs in enumerate(results):
        assert syncs == [("tolist", "parallel/dispatch/base.py")] * (hops * moe_layers[rank]), (dispatcher, rank, syncs)
