"""The `deepep` dispatcher: the `native` dispatcher (`parallel.dispatch.native`) over `deep_ep.Buffer`.

The native dispatcher is written against DeepEP's Buffer API, so DeepEP's own buffer drops in. What
differs is around the buffer, and lives here:
- sizes come from DeepEP's default dispatch and combine configs (`get_nvl_buffer_size_hint`,
  `get_rdma_buffer_size_hint`, as Megatron-LM's `fused_a2a.get_buffer`), and the SM budget is
  DeepEP's static `Buffer.set_num_sms`;
- DeepEP fixes a node at NUM_MAX_NVL_PEERS = 8 GPUs: an EP group of at most 8 ranks inside one node
  takes the intranode kernels, one over whole nodes of 8 the internode kernels; simulated nodes of
  fewer GPUs cannot be expressed (use `native` or `hierarchical`);
- its handles are tuples; `native` reads the fields it counts traffic from by position
  (`parallel.dispatch.native.handle_fields`);
- it moves bfloat16 rows (or FP8 with scales) and combines bfloat16.
Nothing here imports `deep_ep` at module load: the package is optional (GPU-only, built against
NVSHMEM).
"""
from __future__ import annotations

import importlib
from typing import Any

import torch

from kernels_cuda.config import Config, InternodeConfig
from parallel.dispatch.handles import OverlapSwitch
from parallel.dispatch.native import BufferSizes, NativeDispatcher

NVL_PEERS = 8  # DeepEP's NUM_MAX_NVL_PEERS: GPUs per node
MAX_RDMA_PEERS = 20
INSTALL = ("install DeepEP (github.com/deepseek-ai/DeepEP: NVSHMEM, then `python setup.py install` on a GPU "
           "machine)")


def deepep_unavailable(device: str, ep: int, ranks_per_node: int) -> str | None:
    """Why `deepep` cannot serve this EP group here, or None."""
    if importlib.util.find_spec("deep_ep") is None:
        return f"the deep_ep package is not installed; {INSTALL}"
    if device != "cuda":
        return "deep_ep runs on CUDA GPUs only (train.device is cpu)"
    if ranks_per_node == ep and ep <= NVL_PEERS:
        return None
    if ranks_per_node != NVL_PEERS or ep % NVL_PEERS or ep // NVL_PEERS > MAX_RDMA_PEERS:
        return (f"deep_ep takes nodes of {NVL_PEERS} GPUs (at most {MAX_RDMA_PEERS} nodes), not an EP group of {ep} "
                f"over nodes of {ranks_per_node}")
    return None


def make_deepep_dispatcher(group: Any, num_experts: int, ep: int, rank: int, ranks_per_node: int, fp8: bool,
                           comm_sms: int | None, switch: OverlapSwitch | None = None) -> NativeDispatcher:
    """The native dispatcher over `deep_ep.Buffer`s on `group`, completing through `switch` (None: one of
    its own, which only waits; check `deepep_unavailable` first)."""
    deep_ep = importlib.import_module("deep_ep")
    if comm_sms is not None:
        deep_ep.Buffer.set_num_sms(comm_sms)
    internode = ranks_per_node != ep

    def sizes(hidden_bytes: int, num_topk: int) -> BufferSizes:
        configs = (deep_ep.Buffer.get_dispatch_config(ep), deep_ep.Buffer.get_combine_config(ep))
        nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, ep) for c in configs)
        rdma = max(c.get_rdma_buffer_size_hint(hidden_bytes, ep) for c in configs) if internode else 0
        return BufferSizes(nvl, rdma)

    def make(needed: BufferSizes) -> Any:
        return deep_ep.Buffer(group, needed.nvl_bytes, needed.rdma_bytes)

    kind = InternodeConfig.for_nodes(ep // ranks_per_node) if internode else Config()
    return NativeDispatcher(make, num_experts, ep, rank, ranks_per_node, fp8, kind, sizes=sizes,
                            payload_dtypes=(torch.bfloat16,), name="deepep", switch=switch)
