"""Internode Config and its validation: a Python mirror of `validate_internode` in csrc/ep_config.h.

The conditions are the two-hop protocol's deadlock-freedom conditions (see
kernels_cuda/protocol_model_internode.py, whose tests show a violating config deadlocking):
- a producer waits until a whole chunk fits: 1 <= nvl_chunk <= nvl_capacity, and in combine the
  NVLink ring is split into one sub-ring per origin node, so nvl_chunk <= nvl_capacity / nodes;
- the sender warps release their records a round at a time (one token per warp per round), the
  coordinator puts whole chunks, and RDMA heads are released lazily (once they moved by a whole
  chunk); a sender blocked on room may thus face up to W - 1 unreleased records of its round, one
  chunk minus one released but unsent and one chunk minus one consumed but unreleased:
  rdma_capacity >= W + 2 * rdma_chunk - 2 (W = kRdmaSenderWarps; the model found this condition);
- RDMA puts never wrap around the ring: rdma_capacity % rdma_chunk == 0;
- one lane per node and per GPU of a node: nodes <= kMaxRdmaPeers, GPUs per node <= kMaxNvlPeers.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from kernels_cuda import constants as C
from kernels_cuda.config import align_up, combine_record_bytes

RDMA_NOTIFY_INTS = (C.MAX_NVL_PEERS * (1 + C.MAX_LOCAL_EXPERTS) + 1 + 3) // 4 * 4
NVL_NOTIFY_INTS = C.MAX_RDMA_PEERS + C.MAX_LOCAL_EXPERTS


@dataclass(frozen=True)
class InternodeConfig:
    """SMs = 2 * channels; chunks and ring capacities in records, per (channel, producer, consumer)."""

    num_sms: int = 20
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

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

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


def internode_dispatch_record_bytes(hidden_bytes: int, num_scales: int, num_topk: int) -> int:
    """payload | scales | meta (token, source node, GPU bitmask) | top-k ids (int32) | weights, 16-aligned."""
    return align_up(hidden_bytes + num_scales * 4 + 12 + num_topk * 8, C.RECORD_ALIGN)


def rdma_region_bytes(num_nodes: int, num_channels: int, capacity: int, record_bytes: int) -> int:
    """Mirror of make_rdma_layout(...).total (csrc/ep_internode.h)."""
    words = num_channels * num_nodes * 4
    metas, records = words * C.RDMA_META_INTS, num_channels * num_nodes * capacity * record_bytes
    offset = align_up(C.MAX_RDMA_PEERS * 4, C.BUFFER_ALIGN)                                  # notify
    for size in (C.MAX_RDMA_PEERS * RDMA_NOTIFY_INTS * 4,) * 2 + (metas, words, words, metas, records):
        offset = align_up(offset + size, C.BUFFER_ALIGN)  # send_notify, meta, head, tail, send_meta, send/recv data
    return align_up(offset + records, C.BUFFER_ALIGN)


def nvl_region_bytes(num_nodes: int, gpus: int, num_channels: int, capacity: int, record_bytes: int) -> int:
    """Mirror of make_nvl_layout(...).total (csrc/ep_internode.h)."""
    words = num_channels * gpus * num_nodes * 4
    offset = align_up(C.MAX_NVL_PEERS * 4, C.BUFFER_ALIGN)                                   # notify
    for size in (C.MAX_NVL_PEERS * NVL_NOTIFY_INTS * 4, 2 * words, words, words):
        offset = align_up(offset + size, C.BUFFER_ALIGN)                                     # meta, head, tail, data
    return align_up(offset + num_channels * gpus * capacity * record_bytes, C.BUFFER_ALIGN)


def rdma_ring_is_safe(rdma_chunk: int, rdma_capacity: int, sender_warps: int = C.RDMA_SENDER_WARPS) -> bool:
    """The round/lazy-head condition alone (the protocol model varies the number of sender warps)."""
    return rdma_capacity >= sender_warps + 2 * rdma_chunk - 2


def validate_internode(num_channels: int, nvl_chunk: int, nvl_capacity: int, rdma_chunk: int, rdma_capacity: int,
                       num_nodes: int, gpus_per_node: int, hidden_bytes: int, num_topk: int,
                       num_local_experts: int) -> str | None:
    """None if the configuration is safe, else the reason (same text as the C++ validation)."""
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
    if hidden_bytes <= 0 or hidden_bytes % 16:
        return "hidden bytes must be a positive multiple of 16"
    if not 1 <= num_topk <= C.MAX_TOPK:
        return "num_topk must be in [1, kMaxTopk]"
    if not 1 <= num_local_experts <= C.MAX_LOCAL_EXPERTS:
        return "experts per rank must be in [1, kMaxLocalExperts]"
    return None
