"""Training under a batch ramp (train.rampup_batch_size) on data- and pipeline-parallel layouts equals one
process with the same ramp (tiny model, gloo): every step splits its own batch over dp, and on a pipeline
runs the schedule built for its own number of micro-batches. The single-process reference runs in the test
process; the tiny config's train.seed is used (no seed is drawn)."""
import pytest

from moe_train.train import Trainer, read_metrics
from parallel.topology import build_topology
from tests.distributed.test_pipeline_training import SHORT, assert_matches, pipeline_train
from tests.distributed.test_training import corpus_cache, tiny_config  # noqa: F401 - corpus_cache is a fixture

DP_RAMP = ("train.rampup_batch_size=[2,2,6]",)  # batches 2, 4, 8: 1, 2, 4 micro-batches per dp rank
# batches 8, then 16, of micro-batches of 1 over dp 2: 4, then 8 per pipeline (DualPipeV on pp 2 needs 4)
PP_RAMP = (*SHORT, "train.rampup_batch_size=[8,4,8]")


def dp_train(steps: int, cache_dir: str, run_dir: str) -> dict:
    """ZeRO-1 dp 2 x ep 2 under DP_RAMP: each step's metrics, each rank's parameters (experts by global id)."""
    import torch.distributed as dist

    topology = build_topology(pp=1, ep=2, gpus_per_node=2, timeout_s=60)
    try:
        trainer = Trainer(tiny_config(cache_dir, run_dir, "parallel.ep=2", *DP_RAMP), topology)
        metrics = read_metrics([trainer.train_step() for _ in range(steps)])
        first_expert = {n: m.experts.first_expert for n, m in trainer.model.named_modules() if hasattr(m, "experts")}
        params = {name: (first_expert[name.split(".experts.")[0]] if ".experts." in name else None,
                         param.detach().clone()) for name, param in trainer.model.named_parameters()}
        return {"metrics": metrics, "params": params}
    finally:
        topology.destroy_groups()
        dist.barrier()


def reference_run(cache_dir: str, run_dir: str, steps: int, *extra: str) -> Trainer:
    reference = Trainer(tiny_config(cache_dir, run_dir, *extra))
    print(f"seed {reference.cfg.train.seed}")
    reference.history = read_metrics([reference.train_step() for _ in range(steps)])
    return reference


def test_dp2_under_a_ramp_equals_single_process(pools, corpus_cache, tmp_path):  # noqa: F811
    reference = reference_run(corpus_cache, str(tmp_path / "ref"), 3, *DP_RAMP)
    assert [m["global_batch_size"] for m in reference.history] == [2, 4, 8]
    results = pools.get(2).run(dp_train, 3, corpus_cache, str(tmp_path / "run"), deadline_s=300)
    assert all([m["global_batch_size"] for m in r["metrics"]] == [2, 4, 8] for r in results)
    assert_matches(results, reference)


def test_pp2_dp2_under_a_ramp_switches_schedules_and_equals_single_process(pools, corpus_cache, tmp_path):  # noqa: F811
    """DualPipeV on pp 2 x dp 2 (ep 2): a step of 4 micro-batches per pipeline, then one of 8, each through the
    schedule built for its count (the runtime refuses any other), give the single-process losses and
    parameters."""
    reference = reference_run(corpus_cache, str(tmp_path / "ref"), 2, *PP_RAMP, "train.steps=4")
    assert [m["global_batch_size"] for m in reference.history] == [8, 16]
    results = pools.get(4).run(pipeline_train, 2, 2, 1, "dualpipev", 2, corpus_cache, str(tmp_path / "run"), False,
                               *PP_RAMP, deadline_s=300)
    assert {r["schedule"] for r in results} == {"dualpipev"}
    assert all([m["global_batch_size"] for m in r["metrics"]] == [8, 16] for r in results)
    assert_matches(results, reference)
