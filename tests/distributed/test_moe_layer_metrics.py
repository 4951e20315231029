"""The per-MoE-layer metrics (moe_train.moe_metrics) of pp 2 and of ep 2 equal one process's, exactly:
every rank reports every layer's row of the table, also those of the other pipeline stage. The runs use the configs'
fixed train.seed; no seed is drawn."""
import torch.distributed as dist

from moe_train.moe_metrics import MOE_LAYERS, STATS
from moe_train.train import Trainer, read_metrics
from parallel.topology import build_topology
from tests.distributed.test_pipeline_training import SHORT, pipeline_train
from tests.distributed.test_training import corpus_cache, tiny_config  # noqa: F401 - corpus_cache is a fixture

LAYERS = ("layer_1", "layer_2", "layer_3", "mtp_0")  # tiny.yaml's MoE layers
STEPS = 2


def layer_metrics(history: list[dict]) -> list[dict]:
    return [{k: record[k] for k in (MOE_LAYERS, "expert_load_max_over_mean")} for record in history]


def single_process(cache_dir: str, run_dir: str, *extra: str) -> list[dict]:
    trainer = Trainer(tiny_config(cache_dir, run_dir, *extra))
    return layer_metrics(read_metrics([trainer.train_step() for _ in range(STEPS)]))


def ep_train(cache_dir: str, run_dir: str) -> list[dict]:
    topology = build_topology(pp=1, ep=2, gpus_per_node=2, timeout_s=60)
    try:
        trainer = Trainer(tiny_config(cache_dir, run_dir, "parallel.ep=2", "parallel.dispatcher=hierarchical"),
                          topology)
        return layer_metrics(read_metrics([trainer.train_step() for _ in range(STEPS)]))
    finally:
        topology.destroy_groups()
        dist.barrier()


def test_every_layer_is_logged_with_the_single_process_figures_on_pp2_and_ep2(pools, corpus_cache,  # noqa: F811
                                                                                tmp_path):
    pool = pools.get(2)
    pp = pool.run(pipeline_train, 2, 1, 1, "1f1b", STEPS, corpus_cache, str(tmp_path / "pp"), False, deadline_s=300)
    ep = pool.run(ep_train, corpus_cache, str(tmp_path / "ep"), deadline_s=300)
    for name, results, reference in (
            ("pp2", [layer_metrics(r["metrics"]) for r in pp],
             single_process(corpus_cache, str(tmp_path / "ref_pp"), *SHORT, "train.steps=4")),
            ("ep2", ep, single_process(corpus_cache, str(tmp_path / "ref_ep")))):
        assert all(len(r[MOE_LAYERS]) == len(LAYERS) * len(STATS) for r in reference)
        assert any(r[MOE_LAYERS][STATS.index("bias_spread")] > 0 for r in reference)  # the biases moved
        for rank, history in enumerate(results):
            assert history == reference, (name, rank, history, reference)
