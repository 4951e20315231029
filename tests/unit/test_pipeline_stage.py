"""Stage cuts (Megatron layout strings, first/last layer counts) and the stages' global names."""
import pytest
import torch

from model.args import ModelArgs
from model.init import initialize_parameters
from model.transformer import DeepSeekV3
from parallel.pipeline.stage import build_stages, expand_layout, parse_layout, stage_specs

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


def test_stages_keep_global_names_and_initialisation():
    """Every stage parameter has the full model's name and initial value; the last stage of a
    loop placement holds an embedding replica for the MTP, a V rank 0 one shared embedding."""
    reference = DeepSeekV3(ARGS)
    initialize_parameters(reference, 3, ARGS.init_method_std)
    full = dict(reference.named_parameters())
    specs = stage_specs(ARGS, 4, "Et|t|t|tmL")
    seen = set()
    for stage_ids in ((0,), (1,), (2,), (3,)):
        model, _ = build_stages(ARGS, specs, stage_ids)
        initialize_parameters(model, 3, ARGS.init_method_std)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param, full[name], rtol=0, atol=0)
            seen.add(name)
    assert seen == set(full)
    last, _ = build_stages(ARGS, specs, (3,))
    assert "embed_tokens.weight" in dict(last.named_parameters())
    v_rank0, stages = build_stages(ARGS, specs, (0, 3))
    assert stages[0].model is stages[3].model is v_rank0
    assert sum(name == "embed_tokens.weight" for name, _ in v_rank0.named_parameters()) == 1


def test_a_last_stage_without_mtp_layers_gives_the_full_models_lm_loss():
    """mtp_num_layers=0: the last stage holds no embedding replica and its MTP loss is zero."""
    args = ModelArgs(mtp_num_layers=0)
    seed = 11
    print(f"seed {seed}")
    reference = DeepSeekV3(args)
    initialize_parameters(reference, seed, args.init_method_std)
    specs = stage_specs(args, 2, "Ett|ttL")
    first, stages0 = build_stages(args, specs, (0,))
    last, stages1 = build_stages(args, specs, (1,))
    stage0, stage1 = stages0[0], stages1[1]
    for model in (first, last):
        initialize_parameters(model, seed, args.init_method_std)
    assert "embed_tokens.weight" not in dict(last.named_parameters())
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, args.vocab_size, (2, 16), generator=g)
    labels = torch.randint(0, args.vocab_size, (2, 16), generator=g)
    hidden = stage0.forward(0, None, (input_ids, labels))
    loss = stage1.forward(0, hidden, (input_ids, labels))
    torch.testing.assert_close(loss, reference(input_ids, labels=labels).lm_loss)
