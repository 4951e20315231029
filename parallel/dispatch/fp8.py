"""FP8 (e4m3) payload with one scale per token per 128 channels, as DeepEP's normal kernels carry it.

Pure torch, so it works on CPU. The scale is amax / 448 (448 is e4m3's largest finite value),
with DeepEP's amax floor of 1e-4 so all-zero blocks do not divide by zero.
"""
from __future__ import annotations

import torch

BLOCK = 128
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


def quantize_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] -> (e4m3 [N, H], float32 scales [N, H / 128]) with x ~= q * scale per block."""
    tokens, hidden = x.shape
    if hidden % BLOCK:
        raise ValueError(f"FP8 dispatch needs the hidden size to be a multiple of {BLOCK}, got {hidden}")
    blocks = x.detach().float().view(tokens, hidden // BLOCK, BLOCK)
    scales = blocks.abs().amax(-1).clamp(min=AMAX_FLOOR) / E4M3_MAX
    scaled = (blocks / scales.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    return scaled.view(tokens, hidden).to(torch.float8_e4m3fn), scales


def dequantize_e4m3(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    tokens, hidden = q.shape
    blocks = q.float().view(tokens, hidden // BLOCK, BLOCK) * scales.unsqueeze(-1)
    return blocks.view(tokens, hidden).to(dtype)
