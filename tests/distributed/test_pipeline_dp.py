"""Pipeline + data parallel through the Trainer (tiny model, gloo): the gradient reduction that
starts during the step, validation through the pipeline, and bf16.

- Overlapped reduction: one global batch runs through the pipeline twice on the same parameters,
  once reducing each parameter as soon as its gradient is final and once with the end-of-step
  reduction; with dp 2 the two must agree bit for bit (a sum of two numbers has one rounding).
  Replicated parameters (the loop's tied embedding, DualPipe's mirrors) are summed over pair x dp
  by one all-reduce of four numbers instead of a pair sum then a dp sum, so another association:
  fp32 tolerance for those. Every parameter is launched exactly once.
- Validation: `Trainer.evaluate` with pp 2 x dp 2 equals the single-process evaluation.
- bf16: pp 2 with bf16 parameters (zb-h1: split W) follows the single-process bf16 run. The first
  step's loss comes from the same bf16 parameters and the same bf16 forward, so it agrees to rel
  1e-5 (fp32 differs from bf16 there by far more, so this also shows the stages ran in bf16). The
  main grads are fp32 sums of the same bf16 per-micro-batch gradients (the head's two W closures
  per micro-batch, its own and the MTP's, added one by one: another fp32 association), so the
  first step's fp32 main parameters agree to fp32 rounding; a bf16 parameter may still round one
  ulp apart where its main parameter sits at a rounding boundary, and that compounds over later
  steps: rel 1e-4.
"""
import pytest
import torch

from moe_train.train import Trainer, read_metrics
from parallel.topology import build_topology
from tests.distributed.test_training import corpus_cache, tiny_config  # noqa: F401 - corpus_cache is a fixture

SHORT = ("train.seq_length=16", "train.global_batch_size=16")


def _trainer(pp: int, ep: int, schedule: str, cache_dir: str, run_dir: str, *extra: str):
    topology = build_topology(pp=pp, ep=ep, gpus_per_node=1, timeout_s=60)
    config = tiny_config(cache_dir, run_dir, *SHORT, f"parallel.pp={pp}", f"parallel.ep={ep}",
                         f"parallel.schedule={schedule}", *extra)
    return topology, Trainer(config, topology)


def _close(topology, trainer) -> None:
    import torch.distributed as dist

    if trainer is not None:
        trainer.pipeline.destroy()
    topology.destroy_groups()
    dist.barrier()


def overlapped_vs_end_of_step(ep: int, schedule: str, cache_dir: str, run_dir: str) -> dict:
    topology, trainer = _trainer(2, ep, schedule, cache_dir, run_dir)
    try:
        pipeline, sync = trainer.pipeline, trainer.grads
        rows = trainer.sampler.next_batch()
        batches = [(r[:, :-1], r[:, 1:]) for r in rows]
        scale = 1.0 / len(batches)
        names = {id(p): name for name, p in trainer.model.named_parameters()}
        launches = []
        launch = sync.launch
        sync.launch = lambda params, *groups: launches.append([names[id(p)] for p in params]) or launch(params, *groups)
        pipeline.step(batches, scale, sync=sync)
        del sync.launch
        grads = {True: {name: p.grad.clone() for name, p in trainer.model.named_parameters()}}
        pipeline.step(batches, scale)
        sync.reduce()
        grads[False] = {name: p.grad.clone() for name, p in trainer.model.named_parameters()}
        replicated = [names[id(p)] for p in pipeline.replicas.params]
        differing = [name for name, grad in grads[True].items()
                     if name not in replicated and not torch.equal(grad, grads[False][name])]
        for name in replicated:
            torch.testing.assert_close(grads[True][name], grads[False][name], msg=name)
        return {"differing": differing, "launches": [names for names in launches if names],
                "params": list(grads[True]), "replicated": replicated}
    finally:
        _close(topology, trainer)


@pytest.mark.parametrize("schedule, ep", [("zbv", 1), ("zb-h1", 2), ("dualpipe", 1), ("dualpipev", 1)])
def test_overlapped_reduction_equals_end_of_step(pools, corpus_cache, tmp_path, schedule, ep):  # noqa: F811
    results = pools.get(4).run(overlapped_vs_end_of_step, ep, schedule, corpus_cache, str(tmp_path), deadline_s=120)
    for rank, result in enumerate(results):
        assert result["differing"] == [], rank
        launches, params, replicated = result["launches"], result["params"], result["replicated"]
        launched = [name for names in launches for name in names]
        assert sorted(launched) == sorted(params), rank  # each parameter once
        assert len(launches) >= 3, rank  # piece by piece while the step ran
        # replicated parameters alone in their launch, in the pair's common order
        assert [names for names in launches if set(names) & set(replicated)] == [[name] for name in replicated], rank
        if schedule == "dualpipe":  # mirror replicas: every parameter is replicated
            assert sorted(replicated) == sorted(params) and replicated != params, rank  # reordered
        elif schedule == "zb-h1":  # loop placement: the MTP's tied embedding
            assert replicated == ["embed_tokens.weight"], rank
        else:  # V placements: both ends on one rank, nothing replicated
            assert replicated == [], rank


def pipeline_evaluate(ep: int, schedule: str, cache_dir: str, run_dir: str, eval_iters: int) -> float:
    topology, trainer = _trainer(2, ep, schedule, cache_dir, run_dir, f"train.eval_iters={eval_iters}",
                                 "train.eval_interval=1")
    try:
        trainer.train_step()
        loss = trainer.evaluate()
        assert trainer.model.training and all(not s.parts for s in trainer.pipeline.stages.values())
        return loss
    finally:
        _close(topology, trainer)


@pytest.mark.parametrize("schedule, ep", [("dualpipev", 2), ("dualpipe", 1)])
def test_validation_equals_single_process(pools, corpus_cache, tmp_path, schedule, ep):  # noqa: F811
    """3 validation micro-batches on dp 2: one replica runs a padding micro-batch it does not count."""
    reference = Trainer(tiny_config(corpus_cache, str(tmp_path / "ref"), *SHORT, "train.eval_iters=3"))
    reference.train_step()
    expected = reference.evaluate()
    results = pools.get(4).run(pipeline_evaluate, ep, schedule, corpus_cache, str(tmp_path / "run"), 3,
                               deadline_s=120)
    assert results == pytest.approx([expected] * 4, rel=1e-5)


def bf16_losses(cache_dir: str, run_dir: str, steps: int) -> list[float]:
    topology, trainer = _trainer(2, 1, "zb-h1", cache_dir, run_dir, "train.precision=bf16")
    try:
        return [m["loss"] for m in read_metrics([trainer.train_step() for _ in range(steps)])]
    finally:
        _close(topology, trainer)


def test_bf16_pipeline_follows_single_process(pools, corpus_cache, tmp_path):  # noqa: F811
    reference = Trainer(tiny_config(corpus_cache, str(tmp_path / "ref"), *SHORT, "train.precision=bf16"))
    expected = [m["loss"] for m in read_metrics([reference.train_step() for _ in range(3)])]
    results = pools.get(2).run(bf16_losses, corpus_cache, str(tmp_path / "run"), 3, deadline_s=120)
    fp32 = [m["loss"] for m in read_metrics([Trainer(tiny_config(corpus_cache, str(tmp_path / "fp32"),
                                                                     *SHORT)).train_step()])]
    for losses in results:
        print(f"|pp 2 - one process| / one process: {[abs(a - b) / b for a, b in zip(losses, expected)]}; "
              f"first step fp32 vs bf16 {abs(fp32[0] - expected[0]) / expected[0]:.2g}")
        assert losses[0] == pytest.approx(expected[0], rel=1e-5)
        assert abs(fp32[0] - expected[0]) > 10 * abs(losses[0] - expected[0])
        assert losses[1:] == pytest.approx(expected[1:], rel=1e-4)
