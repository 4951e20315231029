"""HF transformers' DeepseekV3ForCausalLM is the parity reference for import and export."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_train.checkpoint.hf import load_hf_checkpoint, main as hf_cli, save_hf_checkpoint
from model.transformer import DeepSeekV3
from model.weights import load_weights
from moe_train.checkpoint.dcp import CheckpointError

transformers = pytest.importorskip("transformers")

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
            beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)


def hf_tiny(yarn: bool, seed: int):
    torch.manual_seed(seed)
    kwargs = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                  num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                  q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                  n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                  routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=163840,
                  rope_interleave=True, tie_word_embeddings=False, initializer_range=0.1)
    if yarn:
        kwargs["rope_scaling"] = dict(YARN)
    config = transformers.DeepseekV3Config(**kwargs)
    config._attn_implementation = "eager"
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    return model


def moe_inputs(model, blocks, ids):
    captured = []
    handles = [b.register_forward_pre_hook(lambda m, args: captured.append(args[0].reshape(-1, args[0].shape[-1])))
               for b in blocks]
    with torch.no_grad():
        logits = model(ids).logits
    for h in handles:
        h.remove()
    return logits, captured


@pytest.mark.parametrize("yarn", [False, True])
def test_import_matches_transformers_logits_and_expert_sets(tmp_path, yarn):
    hf = hf_tiny(yarn, seed=11 + yarn)
    hf.save_pretrained(tmp_path)
    ours = load_hf_checkpoint(tmp_path).eval()
    ids = torch.randint(0, 1000, (2, 24))
    hf_blocks = [layer.mlp for layer in hf.model.layers[1:]]
    hf_logits, hf_in = moe_inputs(hf, hf_blocks, ids)
    our_logits, our_in = moe_inputs(ours, ours.moe_blocks(), ids)
    assert (hf_logits - our_logits).abs().max().item() <= 1e-4
    for hf_block, our_block, x_hf, x_ours in zip(hf_blocks, ours.moe_blocks(), hf_in, our_in):
        with torch.no_grad():
            _, _, hf_idx = hf_block.gate(x_hf)
            our_idx = our_block.gate(x_ours).topk_idx
        assert [set(r) for r in hf_idx.tolist()] == [set(r) for r in our_idx.tolist()]


def test_export_loads_in_transformers_with_same_logits(tmp_path):
    hf = hf_tiny(yarn=True, seed=5)
    hf.save_pretrained(tmp_path / "src")
    ours = load_hf_checkpoint(tmp_path / "src").eval()
    for router in ours.routers():
        router.e_score_correction_bias.uniform_(-0.1, 0.1)
    save_hf_checkpoint(ours, tmp_path / "out")
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    ids = torch.randint(0, 1000, (2, 20))
    with torch.no_grad():
        assert (back(ids).logits - ours(ids).logits).abs().max().item() <= 1e-4


def test_mtp_round_trip_in_released_layout(tmp_path):
    """The MTP depth uses the main model's embedding and head tensors (one parameter each, as DeepSeek-V3
    shares them physically), and the export writes the copies the released layout has for it."""
    from model.args import ModelArgs
    model = DeepSeekV3(ModelArgs(mtp_num_layers=1)).eval()
    names = [name for name, _ in model.named_parameters()]
    assert names.count("embed_tokens.weight") == 1 and names.count("lm_head.weight") == 1
    assert not any("embed" in name or "head.weight" in name for name in names if name.startswith("mtp."))
    save_hf_checkpoint(model, tmp_path / "hf")
    tensors = {n: t for file in (tmp_path / "hf").glob("*.safetensors") for n, t in load_file(str(file)).items()}
    names = set(tensors)
    assert "model.layers.4.eh_proj.weight" in names and "model.layers.4.shared_head.norm.weight" in names
    assert "model.layers.4.mlp.experts.7.up_proj.weight" in names
    assert torch.equal(tensors["model.layers.4.embed_tokens.weight"], model.embed_tokens.weight)
    assert torch.equal(tensors["model.layers.4.shared_head.head.weight"], model.lm_head.weight)
    again = load_hf_checkpoint(tmp_path / "hf")
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_missing_and_misshaped_tensors_are_listed(tmp_path):
    hf = hf_tiny(yarn=False, seed=3)
    hf.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(file))
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(tmp_path)
    text = str(err.value)
    assert "missing: model.layers.2.mlp.experts.5.up_proj.weight" in text
    assert "mis-shaped: model.layers.0.self_attn.o_proj.weight" in text


def test_fp8_block_scaled_weights_are_dequantized(tmp_path):
    hf = hf_tiny(yarn=False, seed=4)
    hf.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    name = "model.layers.0.mlp.down_proj.weight"  # [128, 256]: 1 x 2 blocks of 128 x 128
    weight = tensors[name]
    scale = torch.rand(1, 2) * 0.01 + 0.001
    fp8 = (weight / scale.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
    tensors[name], tensors[name + "_scale_inv"] = fp8, scale
    save_file(tensors, str(file))
    ours = load_hf_checkpoint(tmp_path)
    expected = fp8.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(ours.layers["0"].mlp.down_proj.weight.data, expected)


def test_cli_import_then_export(tmp_path, capsys):
    hf = hf_tiny(yarn=True, seed=6)
    hf.save_pretrained(tmp_path / "hf")
    assert hf_cli(["import", str(tmp_path / "hf"), str(tmp_path / "native")]) == 0
    native = load_weights(tmp_path / "native")
    assert native.args.rope_type == "yarn"
    assert hf_cli(["export", str(tmp_path / "native"), str(tmp_path / "hf2")]) == 0
    config = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert config["rope_scaling"]["factor"] == 40.0 and config["n_group"] == 4
    assert hf_cli(["import", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    assert "config.json: not found" in capsys.readouterr().out
