"""Stage cuts (Megatron layout strings, first/last layer counts), the stages' global names, and
stages that compute the single-process model's losses and gradients."""
import pytest
import torch

from model.args import ModelArgs
from model.init import initialize_parameters
from model.transformer import DeepSeekV3
from parallel.pipeline.ir import ActionKind
from parallel.pipeline.stage import MicroBatch, build_stages, expand_layout, parse_layout, stage_specs
from parallel.pipeline.wgrad import WeightGradStore

ARGS = ModelArgs()  # 4 layers, 1 MTP layer


@pytest.mark.parametrize("layout, expanded", [
    ("Et|(tt|)*3mL", "Et|tt|tt|tt|mL"),
    ("E,t*2|(t|)*2 mL", "Ett|t|t|mL"),
    ("E((t|)*2)*2mL", "Et|t|t|t|mL"),
])
def test_expand_layout(layout, expanded):
    assert expand_layout(layout) == expanded


def test_parse_layout_assigns_global_layer_ids():
    specs = parse_layout("Et|tt|tmL", ARGS, 3)
    assert [s.layers for s in specs] == [(0,), (1, 2), (3,)]
    assert [str(s) for s in specs] == ["Et", "tt", "tmL"]
    assert specs[0].embedding and specs[-1].loss and specs[-1].mtp == 1


@pytest.mark.parametrize("layout, message", [
    ("Et|tt|tmL", "stages"),
    ("Et|t|tmL", "'t'"),
    ("tE|tt|tmL", "'E'"),
    ("Et|ttL|tm", "'L'"),
    ("Etm|tt|tL", "'m'"),
    ("E|tttt||mL", "empty"),
    ("E(tt|tt|mL", "missing"),
    ("Ex|tttt|mL", "unexpected"),
])
def test_parse_layout_rejects(layout, message):
    stages = 4 if layout == "Et|tt|tmL" else len(layout.split("|"))
    with pytest.raises(ValueError, match=message):
        parse_layout(layout, ARGS, stages)


def test_first_and_last_stage_counts():
    specs = stage_specs(ModelArgs(num_layers=8), 4, first=1, last=1)
    assert [len(s.layers) for s in specs] == [1, 3, 3, 1]
    assert [len(s.layers) for s in stage_specs(ARGS, 2)] == [2, 2]
    with pytest.raises(ValueError, match="pipeline_layout"):
        stage_specs(ARGS, 3)
    with pytest.raises(ValueError, match="not both"):
        stage_specs(ARGS, 2, "Ett|ttmL", first=2)
    for first, last in ((-1, None), (None, -2), (5, -1)):  # a negative count gave a stage of layers -1, 0, ...
        with pytest.raises(ValueError, match="cannot split"):
            stage_specs(ARGS, 2, first=first, last=last)


def test_stages_keep_global_names_and_initialisation():
    """Every stage parameter has the full model's name and initial value; the last stage of a
    loop placement holds an embedding replica for the MTP, a V rank 0 one shared embedding."""
    reference = DeepSeekV3(ARGS)
    initialize_parameters(reference, 3, ARGS.init_method_std)
    full = dict(reference.named_parameters())
    specs = stage_specs(ARGS, 4, "Et|t|t|tmL")
    seen = set()
    for stage_ids in ((0,), (1,), (2,), (3,)):
        model, _ = build_stages(ARGS, specs, stage_ids, WeightGradStore())
        initialize_parameters(model, 3, ARGS.init_method_std)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param, full[name], rtol=0, atol=0)
            seen.add(name)
    assert seen == set(full)
    last, _ = build_stages(ARGS, specs, (3,), WeightGradStore())
    assert "embed_tokens.weight" in dict(last.named_parameters())
    v_rank0, stages = build_stages(ARGS, specs, (0, 3), WeightGradStore())
    assert stages[0].model is stages[3].model is v_rank0
    assert sum(name == "embed_tokens.weight" for name, _ in v_rank0.named_parameters()) == 1


@pytest.mark.parametrize("layout, ranks", [("Et|t|t|tmL", ((0,), (1,), (2,), (3,))), ("Et|t|t|tmL", ((0, 3), (1, 2))),
                                           ("E|tttt|mL", ((0,), (1, 2)))], ids=["loop", "v", "embedding-and-head-apart"])
def test_stages_chained_give_the_single_process_losses_and_gradients(layout, ranks):
    """Each rank's model runs its stages through the one forward; chained (hidden state handed on,
    its gradient handed back) they give the whole model's loss parts and every parameter gradient."""
    seed, loss_scale = 5, 0.5
    print(f"seed {seed}")
    ids = torch.randint(0, ARGS.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    reference = DeepSeekV3(ARGS).double().train()
    initialize_parameters(reference, 3, ARGS.init_method_std)
    out = reference(inputs, labels, aux_grad_scale=loss_scale)
    (out.loss * loss_scale).backward()
    specs = stage_specs(ARGS, len(layout.split("|")), layout)
    store = WeightGradStore()
    stages, models = {}, []
    for stage_ids in ranks:
        model, rank_stages = build_stages(ARGS, specs, stage_ids, store)
        initialize_parameters(model, 3, ARGS.init_method_std)
        models.append(model.double().train())
        stages.update(rank_stages)
    microbatch = MicroBatch(inputs, labels, loss_scale)
    outputs, x = [], None
    for s in range(len(specs)):
        x_in = None if x is None else x.detach().requires_grad_()
        x = stages[s].forward(0, x_in, microbatch)
        outputs.append((x_in, x))
    grad = torch.ones_like(x)  # the loss stage returns its loss times loss_scale
    for s in reversed(range(len(specs))):
        x_in, x = outputs[s]
        with store.scope(s, 0, ActionKind.BW):
            x.backward(grad)
        grad = None if x_in is None else x_in.grad
    parts = sum(stage.pop_parts()[0] for stage in stages.values())
    expected = torch.stack([out.lm_loss, out.mtp_loss, out.aux_loss]).double()
    torch.testing.assert_close(parts[:2], expected[:2], rtol=1e-12, atol=0)
    torch.testing.assert_close(parts[2], expected[2], rtol=1e-6, atol=0)  # the routers' losses are fp32
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}
    summed: dict[str, torch.Tensor] = {}
    for model in models:  # an embedding replica's gradient is summed with the first stage's
        for name, param in model.named_parameters():
            summed[name] = summed[name] + param.grad if name in summed else param.grad
    assert summed.keys() == ref_grads.keys()
    for name, grad in summed.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-10, atol=1e-12, msg=name)


def test_a_last_stage_without_mtp_layers_gives_the_full_models_lm_loss():
    """mtp_num_layers=0: the last stage holds no embedding replica and its MTP loss is zero."""
    args = ModelArgs(mtp_num_layers=0)
    seed = 11
    print(f"seed {seed}")
    reference = DeepSeekV3(args)
    initialize_parameters(reference, seed, args.init_method_std)
    specs = stage_specs(args, 2, "Ett|ttL")
    store = WeightGradStore()
    first, stages0 = build_stages(args, specs, (0,), store)
    last, stages1 = build_stages(args, specs, (1,), store)
    stage0, stage1 = stages0[0], stages1[1]
    for model in (first, last):
        initialize_parameters(model, seed, args.init_method_std)
    assert "embed_tokens.weight" not in dict(last.named_parameters())
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, args.vocab_size, (2, 16), generator=g)
    labels = torch.randint(0, args.vocab_size, (2, 16), generator=g)
    microbatch = MicroBatch(input_ids, labels, 1.0)
    hidden = stage0.forward(0, None, microbatch)
    loss = stage1.forward(0, hidden, microbatch)
    torch.testing.assert_close(loss, reference(input_ids, labels=labels, aux_grad_scale=1.0).lm_loss)
