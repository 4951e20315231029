"""Pipeline-parallel training through the Trainer equals the single-process run (tiny model, gloo).

The single-process reference runs in the test process; the workers return their losses, grad
norms and the parameters of their stages (global names; experts by global id), compared there.
"""
import pytest
import torch

from moe_train.train import Trainer, read_metrics
from parallel.data_parallel import is_expert_parameter
from parallel.topology import build_topology
from tests.distributed.test_training import corpus_cache, tiny_config  # noqa: F401 - corpus_cache is a fixture

SHORT = ("train.seq_length=16", "train.global_batch_size=16")


def pipeline_train(pp: int, ep: int, gpus_per_node: int, schedule: str, steps: int, cache_dir: str, run_dir: str,
                   resume: bool, *extra: str) -> dict:
    import torch.distributed as dist

    topology = build_topology(pp=pp, ep=ep, gpus_per_node=gpus_per_node, timeout_s=60)
    trainer = None
    try:
        config = tiny_config(cache_dir, run_dir, *SHORT, f"parallel.pp={pp}", f"parallel.ep={ep}",
                             f"parallel.schedule={schedule}", "parallel.dispatcher=hierarchical" if ep > 1 else
                             "parallel.dispatcher=local", f"checkpoint.resume={'auto' if resume else 'none'}",
                             "train.steps=4", *extra)
        trainer = Trainer(config, topology)
        metrics = read_metrics([trainer.train_step() for _ in range(steps)])
        hook = trainer.pipeline.runtime.fb_overlap
        if resume:
            trainer.save()
        first_expert = {n: m.experts.first_expert for n, m in trainer.model.named_modules() if hasattr(m, "experts")}
        params = {}
        for name, param in trainer.model.named_parameters():
            if is_expert_parameter(name):
                start = first_expert[name.split(".experts.")[0]]
                params[name] = (start, param.detach().clone())
            else:
                params[name] = (None, param.detach().clone())
        return {"metrics": metrics, "params": params,
                "dispatcher": type(trainer.model.moe_blocks()[0].dispatcher).__name__ if trainer.model.moe_blocks()
                else None, "overlap": None if hook is None else (hook.stats.pairs, hook.stats.hidden),
                "schedule": trainer.pipeline.lowered.schedule.name}
    finally:
        if trainer is not None:
            trainer.pipeline.destroy()
        topology.destroy_groups()
        dist.barrier()


def reference_run(cache_dir: str, run_dir: str, steps: int) -> Trainer:
    reference = Trainer(tiny_config(cache_dir, run_dir, *SHORT, "train.steps=4"))
    reference.history = read_metrics([reference.train_step() for _ in range(steps)])
    return reference


def assert_matches(results: list[dict], reference: Trainer, first_step: int = 0, params: bool = True) -> None:
    """Metrics of steps first_step.. equal the reference's; with `params`, the final parameters too."""
    expected = reference.history[first_step:first_step + len(results[0]["metrics"])]
    for rank, result in enumerate(results):
        for got, want in zip(result["metrics"], expected):
            for key in ("loss", "lm_loss", "mtp_loss", "aux_loss", "grad_norm", "expert_load_max_over_mean"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-9), (rank, key)
    if not params:
        return
    ref_params = dict(reference.model.named_parameters())
    seen = set()
    for result in results:
        for name, (start, value) in result["params"].items():
            expected_param = ref_params[name].detach()
            if start is not None:
                expected_param = expected_param[start:start + value.shape[0]]
            torch.testing.assert_close(value, expected_param, rtol=1e-5, atol=4e-5, msg=name)
            seen.add(name)
    assert seen == set(ref_params)


@pytest.mark.parametrize("schedule, ep, gpus_per_node", [("dualpipev", 4, 2), ("zb-h1", 2, 1)])
def test_pp2_dp4_equals_single_process(pools, corpus_cache, tmp_path, schedule, ep, gpus_per_node):  # noqa: F811
    reference = reference_run(corpus_cache, str(tmp_path / "ref"), 2)
    results = pools.get(8).run(pipeline_train, 2, ep, gpus_per_node, schedule, 2, corpus_cache,
                               str(tmp_path / "run"), False, deadline_s=300)
    assert {r["dispatcher"] for r in results} == {"HierarchicalDispatcher"}
    assert_matches(results, reference)


def test_zb_auto_from_measured_costs_switches_after_its_warm_up_and_equals_single_process(
        pools, corpus_cache, tmp_path):  # noqa: F811
    """zb-auto without parallel.zb_costs: 2 steps of zb-h1 time F, B and W, then zb-auto's schedule runs;
    the 4 steps' losses and the parameters equal one process's."""
    reference = reference_run(corpus_cache, str(tmp_path / "ref"), 4)
    results = pools.get(2).run(pipeline_train, 2, 1, 2, "zb-auto", 4, corpus_cache, str(tmp_path / "run"), False,
                               "parallel.zb_measure_steps=2", deadline_s=300)
    assert {r["schedule"] for r in results} == {"zb-auto"}
    assert_matches(results, reference)


def test_pp2_with_the_native_kernels_equals_single_process(pools, kernels_cpu, corpus_cache, tmp_path):  # noqa: F811
    """PP 2 x DP 4, EP 4 over 2 simulated nodes, DualPipeV with overlapped pairs: the two-hop kernels of
    the CPU emulation, one buffer per process, inside the pairs."""
    reference = reference_run(corpus_cache, str(tmp_path / "ref"), 2)
    results = pools.get(8).run(pipeline_train, 2, 4, 2, "dualpipev", 2, corpus_cache, str(tmp_path / "run"), False,
                               "parallel.dispatcher=native", "parallel.comm_sms=4", deadline_s=300)
    assert {r["dispatcher"] for r in results} == {"NativeDispatcher"}
    assert all(r["overlap"][0] > 0 and r["overlap"][1] > 0 for r in results), [r["overlap"] for r in results]
    assert_matches(results, reference)


def test_checkpoint_resumes_with_another_pipeline(pools, corpus_cache, tmp_path):  # noqa: F811
    """pp 2 x dp 2 (ep 2, ZB-H1, 2 stages) saves after 2 steps; pp 2 x dp 1 (DualPipeV, 4 stages) resumes."""
    run_dir = str(tmp_path / "run")
    reference = reference_run(corpus_cache, str(tmp_path / "ref"), 4)
    before = pools.get(4).run(pipeline_train, 2, 2, 1, "zb-h1", 2, corpus_cache, run_dir, True, deadline_s=300)
    assert_matches(before, reference, params=False)
    after = pools.get(2).run(pipeline_train, 2, 1, 1, "dualpipev", 2, corpus_cache, run_dir, True, deadline_s=300)
    assert_matches(after, reference, first_step=2)


RECOMPUTE_ALL = "model.recompute_modules=[layernorm,mla_up_proj,moe_act]"


def train_with_and_without_recompute(cache_dir: str, run_dir: str) -> list[dict]:
    """The same 2 steps of EP 2 x PP 2 x DP 2 (DualPipeV, overlapped pairs, split W) twice: storing
    everything, then with DeepSeek-V3's selective recompute."""
    return [pipeline_train(2, 2, 1, "dualpipev", 2, cache_dir, f"{run_dir}-{i}", False, *extra)
            for i, extra in enumerate([(), (RECOMPUTE_ALL,)])]


def test_selective_recompute_is_bit_identical_on_ep2_pp2_dp2(pools, corpus_cache, tmp_path):  # noqa: F811
    """fp32: the selective recompute modules change no loss, gradient norm or parameter by one bit,
    through the split backward (deferred W), the overlapped F/B pairs and the two-hop dispatcher."""
    for rank, (plain, again) in enumerate(pools.get(4).run(train_with_and_without_recompute, corpus_cache,
                                                            str(tmp_path / "run"), deadline_s=300)):
        assert again["overlap"][0] > 0, again["overlap"]
        assert plain["metrics"] == again["metrics"], rank
        assert plain["params"].keys() == again["params"].keys()
        for name, (_, value) in plain["params"].items():
            assert torch.equal(value, again["params"][name][1]), (rank, name)
