"""Parameter counts and FLOPs against the reference brief and against real module sizes."""
import dataclasses

import pytest

from model.args import ModelArgs
from model.flops import count_parameters, training_flops_per_token
from model.transformer import DeepSeekV3
from moe_train.config import load_config


def test_deepseek_v3_671b_numbers():
    args = load_config("moe_train/configs/dsv3_671b.yaml").model
    counts = count_parameters(args)
    assert round(counts.total / 1e9, 1) == 671.0
    assert round(counts.activated / 1e9, 1) == 37.6
    assert round(counts.mtp_total / 1e9, 2) == 11.61
    assert training_flops_per_token(args, 4096) / 1e9 == pytest.approx(250.5, abs=0.05)
    assert training_flops_per_token(args, 4096, with_mtp=True) / 1e9 == pytest.approx(260.6, abs=0.1)
    full = training_flops_per_token(args, 4096, causal=False) - training_flops_per_token(args, 4096)
    assert full / 1e9 == pytest.approx(30.70, abs=0.01)


@pytest.mark.parametrize("q_lora", [48, None])
def test_counts_equal_module_sizes(q_lora):
    args = dataclasses.replace(ModelArgs(), q_lora_rank=q_lora)
    model = DeepSeekV3(args)
    counts = count_parameters(args)
    main = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("mtp."))
    mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    assert counts.total == main and counts.mtp_total == mtp
    # activated: one MoE layer computes top-k of its experts
    expert = 3 * args.hidden_size * args.moe_ffn_hidden_size
    idle = args.num_moe_layers * (args.num_moe_experts - args.moe_router_topk) * expert
    assert counts.activated == main - idle


def test_flops_scale_with_tokens_computed():
    args = ModelArgs()
    one = training_flops_per_token(args, 64)
    two = training_flops_per_token(args, 128)
    attention_per_token = 6 * args.num_layers * args.num_attention_heads * (24 + 16) * 64 / 2
    assert two - one == pytest.approx(attention_per_token)
    counts = count_parameters(args)
    head = args.vocab_size * args.hidden_size
    mtp_extra = training_flops_per_token(args, 64, with_mtp=True) - one
    assert mtp_extra == pytest.approx(6 * (counts.mtp_activated + head) + attention_per_token / args.num_layers)
