"""LR, bias-rate and MTP-weight schedules at their key steps, and the optimizer's groups."""
import math

import pytest
import torch

from model.args import ModelArgs
from model.transformer import DeepSeekV3
from moe_train.config import OptimConfig, load_config
from moe_train.optim import build_optimizer
from parallel.data_parallel import build_buffers
from moe_train.schedules import bias_update_rate, learning_rate, mtp_loss_scale


def test_warmup_then_cosine():
    o = OptimConfig(lr=1.0, min_lr=0.1, lr_warmup_steps=10, lr_schedule="cosine")
    assert learning_rate(0, o, 110) == pytest.approx(0.1)
    assert learning_rate(9, o, 110) == pytest.approx(1.0)
    assert learning_rate(10, o, 110) == pytest.approx(1.0)
    assert learning_rate(60, o, 110) == pytest.approx(0.1 + 0.9 * 0.5)
    assert learning_rate(110, o, 110) == pytest.approx(0.1)
    assert learning_rate(35, o, 110) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))


def test_deepseek_v3_shape_with_the_papers_numbers():
    """The recipe counts its steps at the final batch of 15,360 (its batch ramp's first 2,000 steps, the
    paper's warm-up, take 4,096 samples each: 533 final batches)."""
    o = load_config("moe_train/configs/dsv3_671b.yaml").optim
    total = 235240

    def warm_up(k):  # the 0-based ramp step k < 2000: 4096 samples before it each
        return learning_rate(k * 4096 / 15360, o, total, 4096 / 15360)

    assert warm_up(0) == pytest.approx(2.2e-4 * (4096 / 15360) / 533)
    assert warm_up(999) == pytest.approx(2.2e-4 * (1000 * 4096 / 15360) / 533)
    assert warm_up(1997) < 2.2e-4 and warm_up(1998) == 2.2e-4  # the peak from the 1,999th step on
    assert learning_rate(2000, o, total) == pytest.approx(2.2e-4)
    assert learning_rate(158945, o, total) == pytest.approx(2.2e-4)  # constant until 10T tokens
    mid = 158946 + 68347 // 2
    assert learning_rate(mid, o, total) == pytest.approx((2.2e-4 + 2.2e-5) / 2, rel=1e-4)
    assert learning_rate(158946 + 68347, o, total) == pytest.approx(2.2e-5)  # 14.3T: cosine done
    assert learning_rate(total - 2655, o, total) == pytest.approx(2.2e-5)  # the 333B-token hold
    assert learning_rate(total - 2654, o, total) == pytest.approx(7.3e-6)  # the final 167B tokens
    model = load_config("moe_train/configs/dsv3_671b.yaml").model
    assert bias_update_rate(227292, o, model) == 1e-3 and bias_update_rate(227293, o, model) == 0.0
    assert mtp_loss_scale(158945, o, model) == 0.3 and mtp_loss_scale(158946, o, model) == 0.1


def test_constant_schedule_and_no_switch():
    o = OptimConfig(lr=0.5, lr_warmup_steps=0, lr_schedule="constant")
    assert {learning_rate(s, o, 100) for s in (0, 50, 99)} == {0.5}
    model = ModelArgs(moe_router_bias_update_rate=0.01, mtp_loss_scaling_factor=0.2)
    assert bias_update_rate(10**9, o, model) == 0.01 and mtp_loss_scale(10**9, o, model) == 0.2


def test_optimizer_groups_exclude_norms_from_decay_and_never_see_biases():
    model = DeepSeekV3(ModelArgs())
    optimizer = build_optimizer(model, build_buffers(model, None, torch.float32, shard=False), OptimConfig(weight_decay=0.1))
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    param_of = {id(piece.main): piece.param for piece in optimizer.pieces}  # the AdamW steps their main values
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(names[id(param_of[id(m)])].endswith(("norm.weight", "layernorm.weight")) for m in no_decay["params"])
    assert all(param_of[id(m)].dim() >= 2 for m in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    biases = {id(r.e_score_correction_bias) for r in model.routers()}
    assert not biases & {id(param_of[id(m)]) for g in optimizer.param_groups for m in g["params"]}
    assert isinstance(optimizer.inner, torch.optim.AdamW)
