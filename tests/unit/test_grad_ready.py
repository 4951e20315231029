"""Gradient readiness from the lowered program: each parameter is released once, with its final gradient.

One pipeline rank runs the whole tiny model (V placements: both stages on it, the embedding used by
both ends). Whenever the runtime reports an action, the parameters released by it are copied; at
the end of the step every parameter must have been released once, and its copy must equal the
final gradient bit for bit (nothing was added after the release).
"""
import pytest
import torch

from model.args import ModelArgs
from model.init import initialize_parameters
from parallel.pipeline import build, validate
from parallel.pipeline.grad_ready import GradientReadiness, release_positions, split_weights
from parallel.pipeline.ir import Action
from parallel.pipeline.replicas import release_order
from parallel.pipeline.runtime import PipelineRuntime
from parallel.pipeline.stage import MicroBatch, build_stages, stage_specs
from parallel.mixed_precision import zero_grad_buffers
from parallel.pipeline.wgrad import WeightGradStore

ARGS = ModelArgs()
MICROBATCHES, BATCH, SEQ = 3, 1, 8


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zbv"])
def test_parameters_are_released_with_their_final_gradient(schedule):
    lowered = validate(build(schedule, 1, MICROBATCHES))
    placement = lowered.schedule.placement
    store = WeightGradStore()
    model, stages = build_stages(ARGS, stage_specs(ARGS, placement.num_stages), placement.stages_on(0), store)
    initialize_parameters(model, 1, ARGS.init_method_std)
    readiness = GradientReadiness(lowered.programs[0], {s: stage.parameters() for s, stage in stages.items()},
                                  split_weights([model]))
    released: dict[int, tuple[int, torch.Tensor]] = {}
    actions: list[Action] = []

    def after(action: Action) -> None:
        actions.append(action)
        for param in readiness.done(action):
            assert id(param) not in released
            released[id(param)] = (len(actions), param.grad.clone())

    runtime = PipelineRuntime(lowered, 0, stages, store, ((BATCH, SEQ, ARGS.hidden_size), torch.float32,
                                                          torch.device("cpu")), after_compute=after)
    rows = torch.randint(0, ARGS.vocab_size, (MICROBATCHES, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    readiness.start()
    zero_grad_buffers(model.parameters())
    runtime.step([MicroBatch(r[:, :-1], r[:, 1:], 1 / MICROBATCHES) for r in rows])
    readiness.assert_done()
    params = dict(model.named_parameters())
    assert set(released) == {id(p) for p in params.values()}
    for name, param in params.items():
        assert torch.equal(released[id(param)][1], param.grad), name
        assert param.grad.abs().sum() > 0, name
    positions = {position for position, _ in released.values()}
    if schedule == "1f1b":  # one stage, full backwards: the last BW finishes every gradient
        assert positions == {len(actions)}
    else:  # B finishes norms and router before the last W; the V's stages finish apart
        assert min(positions) < len(actions)
    if schedule == "zbv":
        def at(name: str) -> int:
            return released[id(params[name])][0]

        # the shared embedding waits for the first stage's last B, after the last stage's (the MTP's use)
        assert at("embed_tokens.weight") == at("layers.0.input_layernorm.weight") > at("norm.weight")


@pytest.mark.parametrize("pp", [2, 4])
def test_dualpipe_release_order_waits_for_no_parameter(pp):
    """Released in the pair's common order, a mirrored parameter goes no later (in program steps)
    than the later of the points where the two members finish it; the model's order would hold
    parameters back (every one waits for the embedding)."""
    lowered = validate(build("dualpipe", pp, 8))
    placement = lowered.schedule.placement
    specs = stage_specs(ARGS, placement.num_stages)
    for rank in range(pp // 2):
        model, stages = build_stages(ARGS, specs, placement.stages_on(rank), WeightGradStore())
        stage_params = {s: stage.parameters() for s, stage in stages.items()}
        positions = [release_positions(lowered.programs[r], stage_params, split_weights([model]))
                     for r in (rank, pp - 1 - rank)]
        params = list(model.parameters())

        def wait(order: list) -> list[int]:
            released = [max(positions[0][id(p)] for p in order[:i + 1]) for i in range(len(order))]
            return [at - max(pos[id(p)] for pos in positions) for p, at in zip(order, released)]

        assert max(wait(release_order(params, positions))) <= 0, rank
        assert max(wait(params)) > 0, rank
