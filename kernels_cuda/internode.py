"""Internode (node-limited, two-hop) dispatch/combine on EMULATED ranks: `num_nodes x gpus_per_node`
ranks in this process on one GPU, each with an RDMA region and an NVLink region (DeepEP's
num_rdma_bytes / num_nvl_bytes), one kernel launch for all ranks.

Same list API as `EmulatedGroup` (so `kernels_cuda.rank_views` and the `native` dispatcher run on it):
`get_dispatch_layout`, `dispatch` (fresh or cached with handles), `combine`, `error_record`. Ranks
are numbered rank = node * gpus_per_node + gpu. Real multi-node runs need the NVSHMEM back end,
whose host side is not written yet (see kernels_cuda/build.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kernels_cuda import constants as C
from kernels_cuda.internode_config import InternodeConfig

Payload = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


@dataclass
class InternodeHandle:
    """What combine and cached dispatch reuse (DeepEP's internode handle; int32 tensors)."""

    rdma_channel_prefix_matrix: torch.Tensor  # [N, C]: this rank's tokens to node m in channels <= c
    gbl_channel_prefix_matrix: torch.Tensor   # [R, C]: this rank's tokens to rank r in channels <= c
    recv_rdma_rank_prefix_sum: torch.Tensor   # [N]: records received over RDMA (as rail proxy) from nodes <= n
    recv_rdma_channel_offset: torch.Tensor    # [N, C]: start of (source node, channel) among its records
    recv_gbl_rank_prefix_sum: torch.Tensor    # [R]: rows received from ranks <= s
    recv_gbl_channel_offset: torch.Tensor     # [R, C]: start of (source rank, channel) among its rows
    recv_src_idx: torch.Tensor                # [M]: token index at the source rank of each row
    is_token_in_rank: torch.Tensor            # [T, R] bool
    send_rdma_head: torch.Tensor              # [T, N]: slot of token t in node m's RDMA ring, or negative
    send_nvl_head: torch.Tensor               # [M_rdma, G]: slot of record i in its (node -> GPU j) stream, or negative
    num_recv_tokens: int
    num_rdma_recv_tokens: int
    config: InternodeConfig


class EmulatedInternodeGroup:
    """All ranks of `num_nodes` x `gpus_per_node` in this process on the current GPU."""

    def __init__(self, num_nodes: int, gpus_per_node: int, num_rdma_bytes: int, num_nvl_bytes: int,
                 config: InternodeConfig | None = None, timeout_cycles: int = C.DEFAULT_TIMEOUT_CYCLES,
                 timeout_s: float = 100.0) -> None:
        import kernels_cuda

        self.ext = kernels_cuda.require_built()
        self.num_nodes, self.gpus_per_node = num_nodes, gpus_per_node
        self.num_ranks = num_nodes * gpus_per_node
        self.config = config or InternodeConfig()
        self.timeout_cycles, self.timeout_s = timeout_cycles, timeout_s
        self.runtime = self.ext.EmulatedInternodeRuntime(num_nodes, gpus_per_node, int(num_rdma_bytes),
                                                         int(num_nvl_bytes))

    def get_dispatch_layout(self, topk_idx: Sequence[torch.Tensor], num_experts: int) -> list[tuple[torch.Tensor, ...]]:
        """Per rank: (num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank), as EmulatedGroup."""
        out = []
        for idx in topk_idx:
            per_rank, _per_node, per_expert, in_rank = self._layout(idx, num_experts)
            out.append((per_rank, per_expert, in_rank))
        return out

    def _layout(self, topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
        """(per rank, per node, per expert, is_token_in_rank) from the layout kernel."""
        return tuple(self.ext.get_dispatch_layout(topk_idx.contiguous(), num_experts, self.num_ranks,
                                                  self.gpus_per_node))

    def _settings(self, config: InternodeConfig, **extra) -> dict:
        return {"num_channels": config.num_channels, "nvl_chunk": config.nvl_chunk,
                "nvl_capacity": config.nvl_capacity, "rdma_chunk": config.rdma_chunk,
                "rdma_capacity": config.rdma_capacity, "timeout_cycles": self.timeout_cycles, **extra}

    def _check(self, config: InternodeConfig, hidden_bytes: int, num_topk: int, num_experts: int) -> None:
        problem = config.validate(self.num_nodes, self.gpus_per_node, hidden_bytes, num_topk,
                                  max(1, num_experts // self.num_ranks))
        if problem is not None:
            raise ValueError(f"kernels_cuda: invalid internode config {config}: {problem}")

    def dispatch(self, xs: Sequence[Payload], topk_idx: Sequence[torch.Tensor] | None = None,
                 topk_weights: Sequence[torch.Tensor] | None = None, num_experts: int | None = None,
                 handles: Sequence[InternodeHandle] | None = None, expert_alignment: int = 1,
                 config: InternodeConfig | None = None, stalled_rank: int = -1) -> list[tuple]:
        """Per rank: (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle)."""
        R, N, G = self.num_ranks, self.num_nodes, self.gpus_per_node
        config = config or (handles[0].config if handles else self.config)
        payloads = [x if isinstance(x, tuple) else (x, None) for x in xs]
        rows0, scales0 = payloads[0]
        device, hidden_bytes = rows0.device, rows0.shape[1] * rows0.element_size()
        num_topk = topk_idx[0].shape[1] if topk_idx is not None else 1
        num_experts = num_experts or R
        self._check(config, hidden_bytes, num_topk, num_experts)
        channels = config.num_channels
        ints = dict(dtype=torch.int32, device=device)

        if handles is not None:
            self.runtime.cached_notify([{"rank": r, "num_tokens": x.shape[0]} for r, (x, _) in enumerate(payloads)],
                                       self._settings(config, rewrite_heads=False))
            prefixes = [{k: getattr(h, k) for k in ("rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
                                                    "recv_rdma_rank_prefix_sum", "recv_gbl_rank_prefix_sum",
                                                    "is_token_in_rank")} for h in handles]
            received = [(h.num_recv_tokens, h.num_rdma_recv_tokens, []) for h in handles]
        else:
            if topk_idx is None:
                raise ValueError("dispatch without handles needs topk_idx and num_experts")
            prefixes, notify = [], []
            for r, ((x, _), idx) in enumerate(zip(payloads, topk_idx)):
                per_rank, per_node, per_expert, in_rank = self._layout(idx, num_experts)
                prefix = {"rdma_channel_prefix_matrix": torch.empty(N, channels, **ints),
                          "gbl_channel_prefix_matrix": torch.empty(R, channels, **ints),
                          "recv_rdma_rank_prefix_sum": torch.empty(N, **ints),
                          "recv_gbl_rank_prefix_sum": torch.empty(R, **ints), "is_token_in_rank": in_rank}
                prefixes.append(prefix)
                notify.append({"rank": r, "num_tokens": x.shape[0], "num_tokens_per_rank": per_rank,
                               "num_tokens_per_node": per_node, "num_tokens_per_expert": per_expert, **prefix})
            self.runtime.notify(notify, self._settings(config, num_experts=num_experts,
                                                       expert_alignment=expert_alignment))
            received = self.runtime.wait_recv_counts(R, num_experts // R, self.timeout_s)

        args, outputs = [], []
        for r, ((x, x_scales), prefix, (num_recv, num_rdma, _)) in enumerate(zip(payloads, prefixes, received)):
            idx = None if topk_idx is None else topk_idx[r].contiguous()
            out = {
                "recv_x": torch.empty(num_recv, x.shape[1], dtype=x.dtype, device=device),
                "recv_x_scales": None if x_scales is None else
                torch.empty(num_recv, x_scales.shape[1], dtype=torch.float32, device=device),
                "recv_src_idx": torch.empty(num_recv, **ints),
                "recv_topk_idx": None if idx is None else
                torch.empty(num_recv, num_topk, dtype=torch.int64, device=device),
                "recv_topk_weights": None if idx is None else
                torch.empty(num_recv, num_topk, dtype=torch.float32, device=device),
                "recv_rdma_channel_offset": torch.empty(N, channels, **ints),
                "recv_gbl_channel_offset": torch.empty(R, channels, **ints),
                "send_rdma_head": torch.empty(x.shape[0], N, **ints),
                "send_nvl_head": torch.empty(num_rdma, G, **ints),
            }
            args.append({"rank": r, "num_tokens": x.shape[0], "x": x.contiguous(), "x_scales": x_scales,
                         "scale_token_stride": 0 if x_scales is None else x_scales.stride(0),
                         "scale_hidden_stride": 0 if x_scales is None else x_scales.stride(1),
                         "topk_idx": idx, "topk_weights": None if idx is None else topk_weights[r].float().contiguous(),
                         **prefix, **out})
            outputs.append(out)
        self.runtime.dispatch(args, self._settings(
            config, hidden_bytes=hidden_bytes, num_scales=0 if scales0 is None else scales0.shape[1],
            num_topk=num_topk, num_experts=num_experts, stalled_rank=stalled_rank))

        results = []
        for a, out, (num_recv, num_rdma, per_expert), old in zip(args, outputs, received, handles or [None] * R):
            handle = old or InternodeHandle(
                a["rdma_channel_prefix_matrix"], a["gbl_channel_prefix_matrix"], a["recv_rdma_rank_prefix_sum"],
                out["recv_rdma_channel_offset"], a["recv_gbl_rank_prefix_sum"], out["recv_gbl_channel_offset"],
                out["recv_src_idx"], a["is_token_in_rank"], out["send_rdma_head"], out["send_nvl_head"], num_recv,
                num_rdma, config)
            recv_x = out["recv_x"] if out["recv_x_scales"] is None else (out["recv_x"], out["recv_x_scales"])
            results.append((recv_x, out["recv_topk_idx"], out["recv_topk_weights"], list(per_expert), handle))
        return results

    def combine(self, ys: Sequence[torch.Tensor], handles: Sequence[InternodeHandle],
                topk_weights: Sequence[torch.Tensor] | None = None, config: InternodeConfig | None = None,
                stalled_rank: int = -1) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Per rank: (combined_x, combined_topk_weights): unweighted sums over the ranks each token went to."""
        config = config or handles[0].config
        y0 = ys[0]
        if y0.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"kernels_cuda combine supports bfloat16 and float32 rows, got {y0.dtype}")
        hidden_bytes = y0.shape[1] * y0.element_size()
        num_topk = topk_weights[0].shape[1] if topk_weights is not None else 1
        self._check(config, hidden_bytes, num_topk, self.num_ranks)
        self.runtime.cached_notify([
            {"rank": r, "num_tokens": h.is_token_in_rank.shape[0], "send_rdma_head": h.send_rdma_head,
             "rdma_channel_prefix_matrix": h.rdma_channel_prefix_matrix, "send_nvl_head": h.send_nvl_head,
             "recv_rdma_rank_prefix_sum": h.recv_rdma_rank_prefix_sum,
             "recv_rdma_channel_offset": h.recv_rdma_channel_offset} for r, h in enumerate(handles)],
            self._settings(config, rewrite_heads=True))
        args, results = [], []
        for r, (y, h) in enumerate(zip(ys, handles)):
            tokens = h.is_token_in_rank.shape[0]
            w = None if topk_weights is None else topk_weights[r]
            combined = torch.empty(tokens, y.shape[1], dtype=y.dtype, device=y.device)
            combined_w = None if w is None else torch.empty(tokens, num_topk, dtype=torch.float32, device=y.device)
            args.append({"rank": r, "num_tokens": tokens, "x": y.contiguous(),
                         "topk_weights": None if w is None else w.float().contiguous(),
                         "recv_gbl_rank_prefix_sum": h.recv_gbl_rank_prefix_sum,
                         "recv_gbl_channel_offset": h.recv_gbl_channel_offset,
                         "recv_rdma_rank_prefix_sum": h.recv_rdma_rank_prefix_sum,
                         "recv_rdma_channel_offset": h.recv_rdma_channel_offset, "send_nvl_head": h.send_nvl_head,
                         "send_rdma_head": h.send_rdma_head, "combined_x": combined,
                         "combined_topk_weights": combined_w})
            results.append((combined, combined_w))
        self.runtime.combine(args, self._settings(config, hidden_bytes=hidden_bytes, num_topk=num_topk,
                                                  stalled_rank=stalled_rank, float32=y0.dtype == torch.float32))
        return results

    def error_record(self) -> dict[str, int]:
        """The first device timeout (code 0 = none): role (and its name), rank, channel, peer, head, tail, expected."""
        keys = ("code", "role", "rank", "channel", "peer", "head", "tail", "expected")
        record = dict(zip(keys, self.runtime.error_record()))
        return {**record, "role_name": C.ROLES.get(record["role"], "none")}
