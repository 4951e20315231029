"""FP8 (e4m3) payload with one scale per token per 128 channels, as DeepEP's kernels carry it.

Pure torch, so it works on CPU. The scale is amax / 448 (448 is e4m3's largest finite value),
with DeepEP's amax floor of 1e-4 so all-zero blocks do not divide by zero: the rule our kernels
implement bit for bit, which differs from the training GEMMs' (model.fp8: scale 1 for a zero tile,
a 2^-126 floor on the scale) only for tiles whose amax is below 1e-4.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from model.fp8 import E4M3_MAX, Fp8Tensor, power_of_two_ceil

BLOCK = 128
AMAX_FLOOR = 1e-4


def quantize_e4m3(x: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] -> (e4m3 [N, H], float32 scales [N, H / 128]) with x ~= q * scale per block.
    `round_scale` rounds each scale up to a power of two (2^ceil(log2(amax / 448))), as DeepEP's
    low-latency kernels do for UE8M0 scales."""
    tokens, hidden = x.shape
    if hidden % BLOCK:
        raise ValueError(f"FP8 dispatch needs the hidden size to be a multiple of {BLOCK}, got {hidden}")
    blocks = x.detach().float().view(tokens, hidden // BLOCK, BLOCK)
    scales = blocks.abs().amax(-1).clamp(min=AMAX_FLOOR) / E4M3_MAX
    if round_scale:
        scales = power_of_two_ceil(scales)
    scaled = (blocks / scales.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    return scaled.view(tokens, hidden).to(torch.float8_e4m3fn), scales


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales [..., S] -> their exponent bytes, 4 per int32 (little-endian) [..., S / 4]."""
    if scales.shape[-1] % 4:
        raise ValueError(f"UE8M0 packs 4 scales per int32: {scales.shape[-1]} scales per row (hidden / 128) "
                         "is not a multiple of 4")
    exponents = (scales.contiguous().view(torch.int32) >> 23) & 0xFF
    exponents = exponents.view(*scales.shape[:-1], scales.shape[-1] // 4, 4)
    return exponents[..., 0] | exponents[..., 1] << 8 | exponents[..., 2] << 16 | exponents[..., 3] << 24


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_ue8m0`: int32 [..., S / 4] -> float32 power-of-two scales [..., S]."""
    exponents = torch.stack([(packed >> (8 * j)) & 0xFF for j in range(4)], dim=-1).flatten(-2)
    return (exponents << 23).view(torch.float32)


def dequantize_e4m3(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    tokens, hidden = q.shape
    blocks = q.float().view(tokens, hidden // BLOCK, BLOCK) * scales.unsqueeze(-1)
    return blocks.view(tokens, hidden).to(dtype)


@dataclass(kw_only=True)
class ReceivedFp8Rows:
    """A dispatch handle's hold on the rows it received in FP8 until the experts take them
    (`Dispatcher.take_fp8_rows`): the combine keeps the handle for its backward, the rows must not
    live that long."""

    fp8_rows: Fp8Tensor | None = None

    def take_fp8_rows(self) -> Fp8Tensor | None:
        rows, self.fp8_rows = self.fp8_rows, None
        return rows
