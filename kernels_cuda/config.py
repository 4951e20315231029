"""Kernel configurations (`Config` intranode, `InternodeConfig` two-hop), their validation and buffer
sizing: a Python mirror of csrc/params/config.h and csrc/params/internode_layout.h.

`validate` and `validate_internode` return None for a safe configuration or the same message as the
C++ `validate_intranode` / `validate_internode` (tests/unit/test_kernels_build.py compiles
csrc/host/config_probe.cpp with the host compiler and compares both, sizes included, over grids of
configurations). The conditions are the protocols' deadlock-freedom conditions; the specifications
tests/kernels/protocol_model.py and protocol_model_internode.py show them at work (a violating
config deadlocks):
- a producer waits until a whole chunk fits: 1 <= chunk <= ring capacity; internode, combine splits
  the NVLink ring into one sub-ring per origin node, so nvl_chunk <= nvl_capacity / nodes;
- intranode, every peer is served by its own group of warps in each role, so the warps divide evenly;
- internode, the sender warps release their records a round at a time (one token per warp per round),
  the coordinator puts whole chunks, and RDMA heads are released lazily (once they moved by a whole
  chunk); a sender blocked on room may thus face up to W - 1 unreleased records of its round, one
  chunk minus one released but unsent and one chunk minus one consumed but unreleased:
  rdma_capacity >= W + 2 * rdma_chunk - 2 (W = kRdmaSenderWarps; the model found this condition),
  and RDMA puts never wrap around the ring: rdma_capacity % rdma_chunk == 0;
- counts travel as -v-1 in int32 and one lane serves one rank, node, GPU of a node or top-k slot.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kernels_cuda import constants as C

RDMA_NOTIFY_INTS = (C.MAX_NVL_PEERS * (1 + C.MAX_LOCAL_EXPERTS) + 1 + 3) // 4 * 4
NVL_NOTIFY_INTS = C.MAX_RDMA_PEERS + C.MAX_LOCAL_EXPERTS


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


# Record sizes (RecordLayout::bytes): 4-byte parts, the record 16-aligned.

def _dispatch_record_bytes(hidden_bytes: int, num_scales: int, meta_bytes: int, num_topk: int) -> int:
    """payload | scales (float) | meta | top-k ids (int32) | top-k weights."""
    return align_up(hidden_bytes + num_scales * 4 + meta_bytes + num_topk * 8, C.RECORD_ALIGN)


def dispatch_record_bytes(hidden_bytes: int, num_scales: int, num_topk: int) -> int:
    """Intranode: the meta is the source token index."""
    return _dispatch_record_bytes(hidden_bytes, num_scales, 4, num_topk)


def internode_dispatch_record_bytes(hidden_bytes: int, num_scales: int, num_topk: int) -> int:
    """Internode: the meta is (source token, source node, GPU bitmask of the destination node)."""
    return _dispatch_record_bytes(hidden_bytes, num_scales, 12, num_topk)


def combine_record_bytes(hidden_bytes: int, num_topk: int) -> int:
    return align_up(hidden_bytes + num_topk * 4, C.RECORD_ALIGN)


# Region sizes (the layouts' `total`): parts placed one after another, each on a kBufferAlign boundary.

def _stacked_bytes(*parts: int) -> int:
    offset = 0
    for size in parts:
        offset = align_up(offset + size, C.BUFFER_ALIGN)
    return offset


def buffer_bytes(num_ranks: int, num_channels: int, capacity: int, record_bytes: int) -> int:
    """Size of one rank's intranode buffer (mirror of make_buffer_layout(...).total)."""
    ring_words = num_channels * num_ranks * 4
    return _stacked_bytes(C.MAX_RANKS * 4, C.MAX_RANKS * C.MAX_RANKS * 4,            # barrier, notify_rank
                          C.MAX_RANKS * C.MAX_LOCAL_EXPERTS * 4,                     # notify_expert
                          *(ring_words,) * 4,                                        # start, end, head, tail
                          num_channels * num_ranks * capacity * record_bytes)        # data


def rdma_region_bytes(num_nodes: int, num_channels: int, capacity: int, record_bytes: int) -> int:
    """Mirror of make_rdma_layout(...).total (csrc/params/internode_layout.h)."""
    words = num_channels * num_nodes * 4
    metas, records = words * C.RDMA_META_INTS, num_channels * num_nodes * capacity * record_bytes
    notify = C.MAX_RDMA_PEERS * RDMA_NOTIFY_INTS * 4
    return _stacked_bytes(C.MAX_RDMA_PEERS * 4, notify, notify,  # barrier, notify, send_notify
                          metas, words, words, metas,            # meta, head, tail, send_meta
                          records, records)                      # send_data, recv_data


def nvl_region_bytes(num_nodes: int, gpus: int, num_channels: int, capacity: int, record_bytes: int) -> int:
    """Mirror of make_nvl_layout(...).total (csrc/params/internode_layout.h)."""
    words = num_channels * gpus * num_nodes * 4
    return _stacked_bytes(C.MAX_NVL_PEERS * 4, C.MAX_NVL_PEERS * NVL_NOTIFY_INTS * 4,  # barrier, notify
                          2 * words, words, words,                                     # meta, head, tail
                          num_channels * gpus * capacity * record_bytes)               # data


# Validation: None if the configuration is safe, else the reason (the same text as the C++).

def _validate_rows(hidden_bytes: int, num_topk: int, num_local_experts: int) -> str | None:
    """The checks both validations end with (validate_rows)."""
    if hidden_bytes <= 0 or hidden_bytes % 16:
        return "hidden bytes must be a positive multiple of 16"
    if not 1 <= num_topk <= C.MAX_TOPK:
        return "num_topk must be in [1, kMaxTopk]"
    if not 1 <= num_local_experts <= C.MAX_LOCAL_EXPERTS:
        return "experts per rank must be in [1, kMaxLocalExperts]"
    return None


def validate(num_channels: int, chunk: int, capacity: int, num_ranks: int, hidden_bytes: int, num_topk: int,
             num_local_experts: int, buffer_size: int = 0) -> str | None:
    """Intranode (validate_intranode)."""
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
    if (problem := _validate_rows(hidden_bytes, num_topk, num_local_experts)) is not None:
        return problem
    if buffer_size > 0:
        record = dispatch_record_bytes(hidden_bytes, hidden_bytes // C.FP8_BLOCK_SIZE, num_topk)
        if buffer_bytes(num_ranks, num_channels, capacity, record) > buffer_size:
            return "the buffer is too small for this configuration (see buffer_size_hint)"
    return None


def rdma_ring_is_safe(rdma_chunk: int, rdma_capacity: int, sender_warps: int = C.RDMA_SENDER_WARPS) -> bool:
    """The round/lazy-head condition alone (the protocol model varies the number of sender warps)."""
    return rdma_capacity >= sender_warps + 2 * rdma_chunk - 2


def validate_internode(num_channels: int, nvl_chunk: int, nvl_capacity: int, rdma_chunk: int, rdma_capacity: int,
                       num_nodes: int, gpus_per_node: int, hidden_bytes: int, num_topk: int,
                       num_local_experts: int) -> str | None:
    """Internode (validate_internode)."""
    if not 2 <= num_nodes <= C.MAX_RDMA_PEERS:
        return "num_nodes must be in [2, kMaxRdmaPeers]"
    if not 1 <= gpus_per_node <= C.MAX_NVL_PEERS:
        return "gpus_per_node must be in [1, kMaxNvlPeers]"
    if not 1 <= num_channels <= C.MAX_CHANNELS:
        return "num_channels must be in [1, kMaxChannels]"
    if nvl_chunk < 1 or rdma_chunk < 1:
        return "chunks must be >= 1"
    if nvl_chunk > nvl_capacity:
        return "nvl_chunk must not exceed nvl_capacity: a forwarder waits for room for a whole chunk"
    if nvl_capacity % num_nodes:
        return "nvl_capacity must be a multiple of num_nodes (combine splits the ring per origin node)"
    if nvl_chunk > nvl_capacity // num_nodes:
        return ("nvl_chunk must not exceed nvl_capacity / num_nodes: a combine NVLink sender waits for room for "
                "a whole chunk in its origin node's sub-ring")
    if rdma_capacity % rdma_chunk:
        return "rdma_capacity must be a multiple of rdma_chunk (RDMA puts never wrap)"
    if not rdma_ring_is_safe(rdma_chunk, rdma_capacity):
        return ("rdma_capacity must be >= kRdmaSenderWarps + 2 * rdma_chunk - 2: a blocked sender may face a round "
                "of unreleased records, a chunk of unsent ones and a chunk of consumed but unreleased slots")
    return _validate_rows(hidden_bytes, num_topk, num_local_experts)


@dataclass(frozen=True)
class _SmConfig:
    """SMs = 2 * num_channels (a sender and a receiver SM per channel); tokens are split into
    num_channels contiguous ranges."""

    num_sms: int = 20

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2


@dataclass(frozen=True)
class Config(_SmConfig):
    """DeepEP-style intranode config: chunk and ring capacity in records."""

    num_max_send_tokens: int = 6
    num_max_recv_tokens: int = 256

    def validate(self, num_ranks: int, hidden_bytes: int, num_topk: int, num_local_experts: int,
                 buffer_size: int = 0) -> str | None:
        return validate(self.num_channels, self.num_max_send_tokens, self.num_max_recv_tokens, num_ranks,
                        hidden_bytes, num_topk, num_local_experts, buffer_size)

    def buffer_size_hint(self, num_ranks: int, hidden_bytes: int, num_topk: int) -> int:
        """Bytes per rank for payload rows of up to `hidden_bytes` (FP8 scales included)."""
        record = dispatch_record_bytes(hidden_bytes, hidden_bytes // C.FP8_BLOCK_SIZE, num_topk)
        return buffer_bytes(num_ranks, self.num_channels, self.num_max_recv_tokens, record)


@dataclass(frozen=True)
class InternodeConfig(_SmConfig):
    """Chunks and ring capacities in records, per (channel, producer, consumer)."""

    nvl_chunk: int = 6
    nvl_capacity: int = 288
    rdma_chunk: int = 16
    rdma_capacity: int = 128

    @classmethod
    def for_nodes(cls, num_nodes: int, **fields: int) -> InternodeConfig:
        """The defaults (or `fields`) with the NVLink ring rounded down to a multiple of `num_nodes`,
        which combine needs (it splits the ring per origin node): 288 records serve 2, 3, 4, 6, 8, 9,
        12 and 16 nodes as they are, 280 serve 20 nodes."""
        config = cls(**fields)
        return replace(config, nvl_capacity=max(config.nvl_capacity // num_nodes, config.nvl_chunk) * num_nodes)

    def validate(self, num_nodes: int, gpus_per_node: int, hidden_bytes: int, num_topk: int,
                 num_local_experts: int) -> str | None:
        return validate_internode(self.num_channels, self.nvl_chunk, self.nvl_capacity, self.rdma_chunk,
                                  self.rdma_capacity, num_nodes, gpus_per_node, hidden_bytes, num_topk,
                                  num_local_experts)

    def buffer_size_hints(self, num_nodes: int, gpus_per_node: int, hidden_bytes: int,
                          num_topk: int) -> tuple[int, int]:
        """(RDMA bytes, NVLink bytes) per rank for BF16 rows of `hidden_bytes`: room for the larger of the
        dispatch record (FP8 scales included) and a float32 combine record of the same width."""
        dispatch = internode_dispatch_record_bytes(hidden_bytes, hidden_bytes // C.FP8_BLOCK_SIZE, num_topk)
        record = max(dispatch, combine_record_bytes(2 * hidden_bytes, num_topk))
        return (rdma_region_bytes(num_nodes, self.num_channels, self.rdma_capacity, record),
                nvl_region_bytes(num_nodes, gpus_per_node, self.num_channels, self.nvl_capacity, record))


def combine_row_shape(rows: Any, topk_weights: Any) -> tuple[int, int]:
    """(hidden bytes, top-k) of a combine's rows (torch tensors); the kernels sum bfloat16 or float32."""
    import torch

    if rows.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"kernels_cuda combine supports bfloat16 and float32 rows, got {rows.dtype}")
    return rows.shape[1] * rows.element_size(), 1 if topk_weights is None else topk_weights.shape[1]
