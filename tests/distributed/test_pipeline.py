"""The pipeline runtime equals the single-process model for every schedule (gloo, CPU).

Each rank builds its stages and, as the independent reference, the whole single-process model
with the same initialisation; both run the same fresh micro-batches for two SGD steps. Checked
on every rank: the loss stage's per-micro-batch losses, every gradient of the rank's parameters
(after the replica sums), the parameters after each step, and that the W store, the P2P queue and
the runtime's activation bookkeeping are empty after each step.
"""
import pytest
import torch

from model.args import ModelArgs
from model.init import initialize_parameters
from model.transformer import DeepSeekV3
from parallel.pipeline import build, validate
from parallel.pipeline.replicas import PipelineReplicas
from parallel.pipeline.runtime import PipelineRuntime
from parallel.pipeline.stage import MicroBatch, ModelStage, build_stages, stage_specs
from parallel.mixed_precision import zero_grad_buffers
from parallel.pipeline.wgrad import WeightGradStore

SEED, BATCH, SEQ, LR = 7, 1, 8, 0.05
TOLERANCES = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=4e-5)}


def micro_batches(args: ModelArgs, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, args.vocab_size, (count, BATCH, SEQ + 1), generator=gen)
    return [(r[:, :-1], r[:, 1:]) for r in rows]


def reference_step(model: DeepSeekV3, batches, scale: float) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    losses = []
    for ids, labels in batches:
        out = model(ids, labels, aux_grad_scale=scale)
        (out.loss * scale).backward()
        losses.append((out.lm_loss + model.args.mtp_loss_scaling_factor * out.mtp_loss).detach())
    return losses


def loss_stage_losses(stage: ModelStage, mtp_loss_scale: float) -> dict[int, torch.Tensor]:
    """Per micro-batch, the loss stage's lm_loss + mtp_loss_scale * mtp_loss from its loss parts, in the
    losses' own fp32 (the parts are their exact float64 copies)."""
    return {mb: parts[0].float() + mtp_loss_scale * parts[1].float() for mb, parts in stage.pop_parts().items()}


def pipeline_matches_reference(schedule: str, microbatches: int, virtual_stages, layout, num_layers: int,
                               dtype: torch.dtype, input_seed: int) -> dict:
    import torch.distributed as dist

    rank, ranks = dist.get_rank(), dist.get_world_size()
    args = ModelArgs(num_layers=num_layers)
    lowered = validate(build(schedule, ranks, microbatches, virtual_stages))
    placement = lowered.schedule.placement
    specs = stage_specs(args, placement.num_stages, layout)
    store = WeightGradStore()
    model, stages = build_stages(args, specs, placement.stages_on(rank), store)
    reference = DeepSeekV3(args)
    for m in (model, reference):
        initialize_parameters(m, SEED, args.init_method_std)
        m.to(dtype)
    replicas = PipelineReplicas(model, placement, rank, [list(range(ranks))], tied_embedding=True, timeout_s=60)
    runtime = PipelineRuntime(lowered, rank, stages, store, ((BATCH, SEQ, args.hidden_size), dtype, torch.device("cpu")))
    optimizer, ref_optimizer = (torch.optim.SGD(m.parameters(), lr=LR) for m in (model, reference))
    ref_params = dict(reference.named_parameters())
    tol = TOLERANCES[dtype]
    scale = 1.0 / microbatches
    checked = {"losses": 0, "params": 0}
    try:
        for step in range(2):
            batches = micro_batches(args, microbatches, input_seed + step)
            zero_grad_buffers(model.parameters())
            runtime.step([MicroBatch(ids, labels, scale) for ids, labels in batches])
            last = placement.num_stages - 1
            losses = loss_stage_losses(stages[last], args.mtp_loss_scaling_factor) if last in stages else {}
            replicas.reduce_gradients()
            expected = reference_step(reference, batches, scale)
            assert store.is_empty() and not runtime.pending_p2p
            for mb, loss in losses.items():
                torch.testing.assert_close(loss, expected[mb].to(loss.dtype), **tol, msg=f"loss of micro-batch {mb}")
            checked["losses"] += len(losses)
            for name, param in model.named_parameters():
                torch.testing.assert_close(param.grad, ref_params[name].grad, **tol,
                                           msg=lambda m, n=name: f"step {step} grad {n}: {m}")
            optimizer.step()
            ref_optimizer.step()
            for name, param in model.named_parameters():
                torch.testing.assert_close(param, ref_params[name], **tol, msg=lambda m, n=name: f"param {n}: {m}")
            checked["params"] = len(list(model.parameters()))
        return {**checked, "peak_live": runtime.peak_live, "stages": sorted(stages)}
    finally:
        replicas.destroy()


# (schedule, ranks, micro-batches, virtual stages, layout, decoder layers, dtype)
CASES = [
    ("1f1b", 2, 4, None, "Et|tttmL", 4, torch.float64),
    ("1f1b", 4, 4, None, None, 4, torch.float32),
    ("interleaved-1f1b", 2, 4, 2, None, 4, torch.float64),
    ("interleaved-1f1b", 4, 4, 2, "E|t|t|t|t|t|t|mL", 6, torch.float64),
    ("zb-h1", 2, 4, None, None, 4, torch.float32),
    ("zb-h1", 4, 6, None, None, 4, torch.float64),
    ("zb-h2", 2, 4, None, None, 4, torch.float64),
    ("zb-h2", 4, 6, None, "Ettt|t|t|mL", 5, torch.float64),
    ("zb-auto", 4, 8, None, None, 4, torch.float64),
    ("zb-interleaved", 2, 4, 2, None, 4, torch.float64),
    ("zb-interleaved", 4, 8, 2, "E|t|t|t|t|t|t|mL", 6, torch.float64),
    ("zbv", 2, 4, None, None, 4, torch.float64),
    ("zbv", 4, 8, None, "E|t|t|t|t|t|t|mL", 6, torch.float64),
    ("dualpipe", 2, 4, None, None, 4, torch.float64),
    ("dualpipe", 4, 8, None, None, 4, torch.float32),
    ("dualpipev", 2, 4, None, "Ett|t|t|tmL", 5, torch.float64),
    ("combined-1f1b", 2, 4, None, None, 4, torch.float64),
    ("dualpipev", 4, 8, None, "E|(t|)*6mL", 6, torch.float64),
]


@pytest.mark.parametrize("schedule, ranks, microbatches, virtual, layout, layers, dtype", CASES,
                         ids=[f"{c[0]}-pp{c[1]}-{str(c[6])[6:]}" for c in CASES])
def test_schedule_equals_single_process(pools, schedule, ranks, microbatches, virtual, layout, layers, dtype):
    input_seed = int(torch.randint(0, 2**31 - 1, ()).item())
    results = pools.get(ranks).run(pipeline_matches_reference, schedule, microbatches, virtual, layout, layers,
                                   dtype, input_seed, deadline_s=120)
    assert sum(r["losses"] for r in results) == 2 * microbatches
    assert all(r["params"] > 0 for r in results)
