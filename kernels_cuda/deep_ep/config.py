"""DeepEP's one `Config` (5 fields) mapped onto our two kernel configs, and its buffer-size hints.

DeepEP describes both paths with `Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)`: the
NVLink chunk and ring (intranode, or the second hop) and the RDMA chunk and ring (the first hop).
`for_kernels(num_ranks)` turns it into a `kernels_cuda.Config` (one node) or `InternodeConfig`
(nodes of `NUM_MAX_NVL_PEERS` GPUs), rounding the rings up to what our protocols need, so every
configuration DeepEP recommends is accepted:
- the RDMA ring to a multiple of its chunk (our RDMA puts never wrap) and to at least
  kRdmaSenderWarps + 2 * chunk - 2 records (kernels_cuda/config.py says why);
- the NVLink ring to a multiple of the number of nodes with at least one chunk per node (combine
  splits it into one sub-ring per origin node).
The hints size those rounded rings for rows of `hidden_bytes`, FP8 scales and our largest top-k
included, so a buffer sized by either config of a pair (as Megatron-core and torchtitan do) serves both.
"""
from __future__ import annotations

from dataclasses import dataclass

from kernels_cuda import constants as C
from kernels_cuda.config import Config as IntranodeConfig
from kernels_cuda.config import InternodeConfig, align_up

# DeepEP's GPUs per node: a group of more ranks spans nodes of this many. Read at every call, so a test
# may lower it to run the internode kernels on simulated nodes of the CPU emulation.
NUM_MAX_NVL_PEERS = 8


def nodes_of(num_ranks: int) -> tuple[int, int]:
    """(nodes, GPUs per node) of a DeepEP group: one node up to NUM_MAX_NVL_PEERS ranks, else nodes of that many."""
    nvl_peers = NUM_MAX_NVL_PEERS
    if num_ranks <= nvl_peers:
        return 1, num_ranks
    if num_ranks % nvl_peers:
        raise ValueError(f"deep_ep: a group of {num_ranks} ranks spans nodes of {nvl_peers} GPUs, so it must be a "
                         f"multiple of {nvl_peers}")
    return num_ranks // nvl_peers, nvl_peers


@dataclass(frozen=True)
class Config:
    """DeepEP's performance config: SMs, then (chunk, ring capacity) in tokens for NVLink and for RDMA."""

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def for_kernels(self, num_ranks: int) -> IntranodeConfig | InternodeConfig:
        """Our kernels' config for a group of `num_ranks` (see the module doc for the rounding)."""
        if self.num_sms % 2:
            raise ValueError(f"deep_ep Config: num_sms must be even (a sender and a receiver SM per channel), "
                             f"got {self.num_sms}")
        nodes, _ = nodes_of(num_ranks)
        nvl_chunk, nvl_ring = self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens
        if nodes == 1:
            return IntranodeConfig(num_sms=self.num_sms, num_max_send_tokens=nvl_chunk, num_max_recv_tokens=nvl_ring)
        rdma_chunk = self.num_max_rdma_chunked_send_tokens
        rdma_ring = max(self.num_max_rdma_chunked_recv_tokens, C.RDMA_SENDER_WARPS + 2 * rdma_chunk - 2)
        return InternodeConfig(num_sms=self.num_sms, nvl_chunk=nvl_chunk,
                               nvl_capacity=align_up(max(nvl_ring, nvl_chunk * nodes), nodes),
                               rdma_chunk=rdma_chunk, rdma_capacity=align_up(rdma_ring, rdma_chunk))

    def _hints(self, hidden_bytes: int, num_ranks: int) -> tuple[int, int]:
        """(NVLink bytes, RDMA bytes) per rank."""
        nodes, gpus = nodes_of(num_ranks)
        ours = self.for_kernels(num_ranks)
        if isinstance(ours, IntranodeConfig):
            return ours.buffer_size_hint(num_ranks, hidden_bytes, C.MAX_TOPK), 0
        rdma, nvl = ours.buffer_size_hints(nodes, gpus, hidden_bytes, C.MAX_TOPK)
        return nvl, rdma

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """num_nvl_bytes per rank for rows of `hidden_bytes` in a group of `num_ranks`."""
        return self._hints(hidden_bytes, num_ranks)[0]

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """num_rdma_bytes per rank (0 when the group is one node, as in DeepEP)."""
        return self._hints(hidden_bytes, num_ranks)[1]
