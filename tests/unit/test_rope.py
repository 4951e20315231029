"""RoPE and YaRN against the reference brief's numbers and a complex-number restatement."""
import math

import pytest
import torch

from model.args import ModelArgs
from model.rope import RotaryEmbedding, apply_rope, rope_frequencies, softmax_scale

V3_YARN = dict(qk_head_dim=128, qk_pos_emb_head_dim=64, rope_type="yarn", rotary_scaling_factor=40,
               original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)


def test_yarn_frequencies_blend_band_10_to_23():
    inv_freq, factor = rope_frequencies(ModelArgs(**V3_YARN))
    base = 1.0 / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert torch.allclose(inv_freq[:11].double(), base[:11], rtol=1e-6)  # j <= 10 keep their frequency
    assert torch.allclose(inv_freq[23:].double(), base[23:] / 40, rtol=1e-6)  # j >= 23 divided by s
    for j in range(11, 23):
        ramp = (j - 10) / 13
        assert inv_freq[j].item() == pytest.approx(base[j].item() * (1 - ramp) + base[j].item() / 40 * ramp, rel=1e-5)
    assert factor == pytest.approx(1.0)


def test_softmax_scale_values():
    assert softmax_scale(ModelArgs(**V3_YARN)) == pytest.approx(0.1352338, rel=1e-6)
    assert softmax_scale(ModelArgs(**{**V3_YARN, "rope_type": "rope"})) == pytest.approx(0.0721688, rel=1e-6)
    # without mscale keys the cos/sin factor is m(s) and there is no softmax factor (HF's rule)
    args = ModelArgs(**{**V3_YARN, "mscale": 0.0, "mscale_all_dim": 0.0})
    assert softmax_scale(args) == pytest.approx(192 ** -0.5)
    assert rope_frequencies(args)[1] == pytest.approx(0.1 * math.log(40) + 1)


def test_interleaved_rope_is_complex_rotation_and_relative():
    args = ModelArgs(qk_pos_emb_head_dim=16)
    cos, sin = RotaryEmbedding(args)(12)
    x = torch.randn(3, 12, 16)
    out = apply_rope(x, cos, sin)
    angles = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))
    expected = torch.view_as_real(torch.view_as_complex(x.view(3, 12, 8, 2)) * angles).flatten(-2)
    assert torch.allclose(out, expected, atol=1e-5)
    q, k = torch.randn(16), torch.randn(16)
    full_cos, full_sin = RotaryEmbedding(args)(40)

    def dot(tq, tk):
        rq = apply_rope(q.expand(40, 16), full_cos, full_sin)[tq]
        rk = apply_rope(k.expand(40, 16), full_cos, full_sin)[tk]
        return (rq * rk).sum().item()
    assert dot(7, 3) == pytest.approx(dot(30, 26), abs=1e-4)
