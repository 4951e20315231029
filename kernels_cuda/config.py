"""Intranode Config, its validation and buffer sizing: a Python mirror of csrc/ep_config.h.

`validate` returns None for a safe configuration or the same message the C++ `validate_intranode`
returns (tests/unit/test_kernels_build.py compiles csrc/host/config_probe.cpp with the host
compiler and compares both over a grid of configurations). The conditions are the ring
protocol's deadlock-freedom conditions; kernels_cuda/protocol_model.py shows them at work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kernels_cuda import constants as C


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def dispatch_record_bytes(hidden_bytes: int, num_scales: int, num_topk: int) -> int:
    """payload | scales (float) | source index (int) | top-k ids (int32) | top-k weights, 16-aligned."""
    return align_up(hidden_bytes + num_scales * 4 + 4 + num_topk * 8, C.RECORD_ALIGN)


def combine_record_bytes(hidden_bytes: int, num_topk: int) -> int:
    return align_up(hidden_bytes + num_topk * 4, C.RECORD_ALIGN)


def buffer_bytes(num_ranks: int, num_channels: int, capacity: int, record_bytes: int) -> int:
    """Size of one rank's buffer (mirror of make_buffer_layout(...).total)."""
    ring_words = num_channels * num_ranks * 4
    offset = align_up(C.MAX_RANKS * 4, C.BUFFER_ALIGN)                                # notify_rank
    offset = align_up(offset + C.MAX_RANKS * C.MAX_RANKS * 4, C.BUFFER_ALIGN)          # notify_expert
    offset = align_up(offset + C.MAX_RANKS * C.MAX_LOCAL_EXPERTS * 4, C.BUFFER_ALIGN)  # channel_start
    for _ in range(4):                                                                 # start, end, head, tail
        offset = align_up(offset + ring_words, C.BUFFER_ALIGN)
    return align_up(offset + num_channels * num_ranks * capacity * record_bytes, C.BUFFER_ALIGN)


@dataclass(frozen=True)
class Config:
    """DeepEP-style intranode config: SMs = 2 * num_channels; chunk and ring capacity in records."""

    num_sms: int = 20
    num_max_send_tokens: int = 6
    num_max_recv_tokens: int = 256

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

    def validate(self, num_ranks: int, hidden_bytes: int, num_topk: int, num_local_experts: int,
                 buffer_size: int = 0) -> str | None:
        return validate(self.num_channels, self.num_max_send_tokens, self.num_max_recv_tokens, num_ranks,
                        hidden_bytes, num_topk, num_local_experts, buffer_size)

    def buffer_size_hint(self, num_ranks: int, hidden_bytes: int, num_topk: int) -> int:
        """Bytes per rank for payload rows of up to `hidden_bytes` (FP8 scales included)."""
        record = dispatch_record_bytes(hidden_bytes, hidden_bytes // C.FP8_BLOCK_SIZE, num_topk)
        return buffer_bytes(num_ranks, self.num_channels, self.num_max_recv_tokens, record)


def validate(num_channels: int, chunk: int, capacity: int, num_ranks: int, hidden_bytes: int, num_topk: int,
             num_local_experts: int, buffer_size: int = 0) -> str | None:
    """None if the configuration is safe, else the reason (same text as the C++ validation)."""
    if not 1 <= num_ranks <= C.MAX_RANKS:
        return "num_ranks must be in [1, kMaxRanks]"
    if C.DISPATCH_WARPS % num_ranks or C.COMBINE_WARPS % num_ranks:
        return "the warps of a block must divide evenly among the ranks (one warp group per peer)"
    if not 1 <= num_channels <= C.MAX_CHANNELS:
        return "num_channels must be in [1, kMaxChannels]"
    if chunk < 1:
        return "num_max_send_tokens (chunk) must be >= 1"
    if chunk > capacity:
        return ("num_max_send_tokens (chunk) must not exceed num_max_recv_tokens (ring capacity): "
                "a producer waits for room for a whole chunk")
    if hidden_bytes <= 0 or hidden_bytes % 16:
        return "hidden bytes must be a positive multiple of 16"
    if not 1 <= num_topk <= C.MAX_TOPK:
        return "num_topk must be in [1, kMaxTopk]"
    if not 1 <= num_local_experts <= C.MAX_LOCAL_EXPERTS:
        return "experts per rank must be in [1, kMaxLocalExperts]"
    if buffer_size > 0:
        record = dispatch_record_bytes(hidden_bytes, hidden_bytes // C.FP8_BLOCK_SIZE, num_topk)
        if buffer_bytes(num_ranks, num_channels, capacity, record) > buffer_size:
            return "the buffer is too small for this configuration (see buffer_size_hint)"
    return None


def combine_row_shape(rows: Any, topk_weights: Any) -> tuple[int, int]:
    """(hidden bytes, top-k) of a combine's rows (torch tensors); the kernels sum bfloat16 or float32."""
    import torch

    if rows.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"kernels_cuda combine supports bfloat16 and float32 rows, got {rows.dtype}")
    return rows.shape[1] * rows.element_size(), 1 if topk_weights is None else topk_weights.shape[1]
