"""Pipeline + data parallel through the Trainer (tiny model, gloo): the gradient reduction that
starts during the step, validation through the pipeline, and bf16.

- Overlapped reduction: one global batch runs through the pipeline twice on the same parameters,
  once reducing each bucket (small ones here) as soon as its gradients are final and once starting
  every bucket's reduction at the end of the step: the reduced ranges agree bit for bit, the
  replicated parameters' (the loop's tied embedding, DualPipe's mirrors, reduced over pair x dp)
  included. Every parameter is launched and every bucket started exactly once, several of them
  during the step, the pair's buckets in the same order.
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
from parallel.data_parallel import is_expert_parameter
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
    topology, trainer = _trainer(2, ep, schedule, cache_dir, run_dir, f"parallel.grad_bucket_elements={BUCKET}")
    try:
        pipeline, sync = trainer.pipeline, trainer.grads
        buckets = sync.buffers.buckets
        rows = trainer.sampler.next_batch()
        batches = [(r[:, :-1], r[:, 1:]) for r in rows]
        scale = 1.0 / len(batches)
        names = {id(p): name for name, p in trainer.model.named_parameters()}
        launches, started, before_finish = [], [], []
        launch, start, finish = sync.launch, sync._start, sync.finish
        sync.launch = lambda params: launches.append([names[id(p)] for p in params]) or launch(params)
        sync._start = lambda bucket: started.append(buckets.index(bucket)) or start(bucket)
        sync.finish = lambda: before_finish.append(len(started)) or finish()
        pipeline.step(batches, scale, sync=sync)
        del sync.launch, sync._start, sync.finish

        def owned() -> dict[str, torch.Tensor]:  # the reduced range of each gradient (ZeRO-1: this rank's)
            return {piece.name: piece.grad.clone() for piece in trainer.optimizer.pieces}

        grads = {True: owned()}
        sync.launch = lambda params: None  # every bucket starts in `finish`, at the end of the step
        pipeline.step(batches, scale, sync=sync)
        del sync.launch
        grads[False] = owned()
        replicated = [names[id(p)] for p in pipeline.replicas.params]
        differing = [name for name, grad in grads[True].items() if not torch.equal(grad, grads[False][name])]
        return {"differing": differing, "launches": [names for names in launches if names],
                "params": list(names.values()), "replicated": replicated, "started": started,
                "before_finish": before_finish[0], "layout": [[names[id(p)] for p in b.params] for b in buckets]}
    finally:
        _close(topology, trainer)


BUCKET = 20_000  # elements: the tiny model's stages fill several buckets


@pytest.mark.parametrize("schedule, ep", [("zbv", 1), ("zb-h1", 2), ("dualpipe", 1), ("dualpipev", 1)])
def test_overlapped_reduction_equals_end_of_step(pools, corpus_cache, tmp_path, schedule, ep):  # noqa: F811
    results = pools.get(4).run(overlapped_vs_end_of_step, ep, schedule, corpus_cache, str(tmp_path), deadline_s=120)
    for rank, result in enumerate(results):
        assert result["differing"] == [], rank
        launches, params, replicated, layout = result["launches"], result["params"], result["replicated"], result["layout"]
        print(f"rank {rank}: {len(layout)} buckets, {result['before_finish']} started during the step")
        launched = [name for names in launches for name in names]
        assert sorted(launched) == sorted(params), rank  # each parameter once
        assert sorted(result["started"]) == list(range(len(layout))), rank  # each bucket once
        assert result["before_finish"] >= 3, rank  # bucket by bucket while the step ran
        # replicated parameters launched in the pair's common order, never with others, and their
        # buckets started in bucket order (the same collectives in the same order on both members)
        assert [n for names in launches if set(names) & set(replicated) for n in names] == replicated, rank
        assert all(set(names) <= set(replicated) for names in launches if set(names) & set(replicated)), rank
        for expert in (False, True):  # one replica group each: pair x dp, pair x expert-dp
            pair_buckets = [i for i, names in enumerate(layout)
                            if set(names) & set(replicated) and is_expert_parameter(names[0]) == expert]
            assert [i for i in result["started"] if i in pair_buckets] == pair_buckets, rank
        if schedule == "dualpipe":  # mirror replicas: every parameter is replicated
            assert sorted(replicated) == sorted(params) and replicated != params, rank  # reordered
            assert layout == results[3 - rank]["layout"], rank  # the pair's buckets are the same
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


def pipeline_losses(cache_dir: str, run_dir: str, steps: int, precision: str) -> list[float]:
    topology, trainer = _trainer(2, 1, "zb-h1", cache_dir, run_dir, f"train.precision={precision}")
    try:
        return [m["loss"] for m in read_metrics([trainer.train_step() for _ in range(steps)])]
    finally:
        _close(topology, trainer)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_low_precision_pipeline_follows_single_process(pools, corpus_cache, tmp_path, precision):  # noqa: F811
    reference = Trainer(tiny_config(corpus_cache, str(tmp_path / "ref"), *SHORT, f"train.precision={precision}"))
    expected = [m["loss"] for m in read_metrics([reference.train_step() for _ in range(3)])]
    results = pools.get(2).run(pipeline_losses, corpus_cache, str(tmp_path / "run"), 3, precision, deadline_s=120)
    fp32 = [m["loss"] for m in read_metrics([Trainer(tiny_config(corpus_cache, str(tmp_path / "fp32"),
                                                                     *SHORT)).train_step()])]
    for losses in results:
        print(f"{precision}: |pp 2 - one process| / one process: {[abs(a - b) / b for a, b in zip(losses, expected)]}; "
              f"first step fp32 vs bf16 {abs(fp32[0] - expected[0]) / expected[0]:.2g}")
        assert losses[0] == pytest.approx(expected[0], rel=1e-5)
        assert abs(fp32[0] - expected[0]) > 10 * abs(losses[0] - expected[0])
        assert losses[1:] == pytest.approx(expected[1:], rel=1e-4)
