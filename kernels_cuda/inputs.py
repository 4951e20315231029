"""Checks of dispatch/combine arguments shared by the intranode and internode engines.

The kernels index raw memory: a wrong dtype, shape, device or alignment would be read as garbage (or
past an end), so each is refused before any launch with a ValueError naming the argument.
"""
from __future__ import annotations

import torch

from kernels_cuda import constants as C

# BF16/FP32 rows, or (FP8 rows, scales): float32 [N, H/128], or int32 [N, H/512] of four packed UE8M0 exponents
Payload = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
UE8M0_PER_WORD = 4
# (num_tokens_per_rank, num_tokens_per_rdma_rank (per node; None on one node), num_tokens_per_expert, is_token_in_rank)
Layout = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]


def check_layout_input(topk_idx: torch.Tensor) -> None:
    if topk_idx.dtype != torch.int64 or topk_idx.dim() != 2:
        raise ValueError(f"kernels_cuda get_dispatch_layout: topk_idx must be int64 [num_tokens, num_topk], got "
                         f"{topk_idx.dtype} of shape {list(topk_idx.shape)}")


def check_dispatch(device: str, x: torch.Tensor, x_scales: torch.Tensor | None, topk_idx: torch.Tensor | None,
                   topk_weights: torch.Tensor | None, expert_alignment: int, rank: int) -> None:
    """One rank's dispatch inputs (x: rows [N, H]; FP8 rows come with float32 scales [N, H / 128])."""
    where = f"kernels_cuda dispatch (rank {rank})"
    if x.dim() != 2:
        raise ValueError(f"{where}: x must be [num_tokens, hidden], got shape {tuple(x.shape)}")
    if x.device.type != device:
        raise ValueError(f"{where}: x is on {x.device}, but this group runs on {device}")
    row_bytes = x.shape[1] * x.element_size()
    if row_bytes % 16:
        raise ValueError(f"{where}: x has rows of {row_bytes} bytes; the kernels copy 16-byte vectors, so a row "
                         "must be a multiple of 16 bytes")
    if x.is_contiguous() and x.data_ptr() % 16:
        raise ValueError(f"{where}: x is not 16-byte aligned (data pointer {x.data_ptr():#x}); pass x.clone()")
    if x_scales is not None:
        per_scale = C.FP8_BLOCK_SIZE * (UE8M0_PER_WORD if x_scales.dtype == torch.int32 else 1)
        want = (x.shape[0], -(-x.shape[1] // per_scale))
        if x_scales.dtype not in (torch.float32, torch.int32):
            raise ValueError(f"{where}: x_scales must be float32 (or int32 packed UE8M0), got {x_scales.dtype}")
        if tuple(x_scales.shape) != want or x.shape[1] % C.FP8_BLOCK_SIZE:
            raise ValueError(f"{where}: x_scales must be [num_tokens, hidden / {per_scale}] = {list(want)} for x of "
                             f"shape {list(x.shape)} ({x_scales.dtype} scales), got {list(x_scales.shape)}")
    if topk_idx is not None:
        if topk_idx.dtype != torch.int64:
            raise ValueError(f"{where}: topk_idx must be int64, got {topk_idx.dtype}")
        if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
            raise ValueError(f"{where}: topk_idx must be [num_tokens, num_topk] with num_tokens = {x.shape[0]}, "
                             f"got {list(topk_idx.shape)}")
        if topk_weights is None or tuple(topk_weights.shape) != tuple(topk_idx.shape):
            got = None if topk_weights is None else list(topk_weights.shape)
            raise ValueError(f"{where}: topk_weights must have topk_idx's shape {list(topk_idx.shape)}, got {got}")
    if expert_alignment < 1:
        raise ValueError(f"{where}: expert_alignment must be >= 1, got {expert_alignment}")


def scale_words(x_scales: torch.Tensor) -> torch.Tensor:
    """The scales as the kernels move them: 4-byte words, copied bit for bit (packed UE8M0 int32 scales
    travel viewed as float32 and come back as int32)."""
    return x_scales.view(torch.float32)


def check_combine(device: str, x: torch.Tensor, num_recv_tokens: int, topk_weights: torch.Tensor | None,
                  rank: int) -> None:
    """One rank's combine inputs: exactly the rows its dispatch received (the handle's count)."""
    where = f"kernels_cuda combine (rank {rank})"
    if x.dim() != 2 or x.shape[0] != num_recv_tokens:
        raise ValueError(f"{where}: x must have the {num_recv_tokens} rows the dispatch received, got shape "
                         f"{list(x.shape)}")
    if x.device.type != device:
        raise ValueError(f"{where}: x is on {x.device}, but this group runs on {device}")
    if (x.shape[1] * x.element_size()) % 16:
        raise ValueError(f"{where}: x has rows of {x.shape[1] * x.element_size()} bytes, not a multiple of 16")
    if topk_weights is not None and (topk_weights.dim() != 2 or topk_weights.shape[0] != num_recv_tokens):
        raise ValueError(f"{where}: topk_weights must have {num_recv_tokens} rows, got shape {list(topk_weights.shape)}")
