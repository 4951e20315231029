"""Rotary position embedding with interleaved pairs, plain and YaRN (DeepSeek-V3 / HF rules)."""
from __future__ import annotations

import math

import torch
from torch import nn

from model.args import ModelArgs


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """m(s, a) = 0.1 * a * ln(s) + 1 for s > 1, else 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(num_rotations: float, dim: int, base: float, original_length: int) -> float:
    return dim * math.log(original_length / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def rope_frequencies(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] (fp32) and the cos/sin multiplier ("attention factor")."""
    dim, base = args.qk_pos_emb_head_dim, args.rotary_base
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if args.rope_type == "rope":
        return inv_freq, 1.0
    factor = args.rotary_scaling_factor
    low = max(math.floor(_correction_dim(args.beta_fast, dim, base, args.original_max_position_embeddings)), 0)
    high = min(math.ceil(_correction_dim(args.beta_slow, dim, base, args.original_max_position_embeddings)),
               dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = inv_freq * (1 - ramp) + (inv_freq / factor) * ramp
    if args.mscale and args.mscale_all_dim:
        attention_factor = yarn_mscale(factor, args.mscale) / yarn_mscale(factor, args.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)
    return inv_freq, attention_factor


def softmax_scale(args: ModelArgs) -> float:
    """1/sqrt(qk head dim), times m(s, mscale_all_dim)^2 under YaRN when mscale_all_dim is set."""
    scale = args.qk_full_head_dim ** -0.5
    if args.rope_type == "yarn" and args.mscale_all_dim:
        scale *= yarn_mscale(args.rotary_scaling_factor, args.mscale_all_dim) ** 2
    return scale


class RotaryEmbedding(nn.Module):
    """Produces fp32 (cos, sin) tables [T, dim/2] for positions start..start+T-1."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        inv_freq, self.attention_factor = rope_frequencies(args)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len: int, device: torch.device | None = None,
                start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, start + seq_len, device=device or self.inv_freq.device, dtype=torch.float32)
        angles = torch.outer(positions, self.inv_freq.to(positions.device))
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2j], x[2j+1]) of x [..., T, dim] by the angles of position t."""
    x32 = x.float()
    even, odd = x32[..., 0::2], x32[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)
