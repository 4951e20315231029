"""`kernels_cuda.deep_ep` in place of DeepEP: the call sequences of Megatron-core's
`megatron/core/transformer/moe/fused_a2a.py` (get_buffer, fused_dispatch, fused_combine, their
backward passes, set_deepep_num_sms) and of torchtitan's DeepEP dispatcher
(`torchtitan/distributed/deepep/deepep.py`), replayed call for call with their arguments against
per-process buffers on the CPU emulation, values checked against the pure-torch reference
(tests/kernels/reference.py), inside one node and over 2 simulated nodes of 2. Where megatron-core is
importable its module itself runs, unmodified.

The replays are written here, after reading those files: the same buffer calls in the same order with
the same arguments (keyword or positional as they pass them), the sizing and reuse rule of their
`get_buffer`, and their autograd structure (dispatch's backward is a combine of the gradients with
the top-k weights, combine's backward a cached dispatch)."""
from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.kernels.deep_ep_alias import deep_ep_installed
from tests.kernels.reference import reference_combine, reference_dispatch

TOKENS, HIDDEN, TOPK, EXPERTS_PER_RANK = 24, 256, 3, 2
TIMEOUT_CYCLES = 60_000_000_000  # 30 s of wall clock: processes time-slice 2 cores


def all_inputs(world: int, seed: int) -> tuple[list, list, list]:
    """Every rank's (bf16 x, topk_idx with empty slots, float32 probs), the same in every process."""
    print(f"rank {dist.get_rank()}: inputs seed {seed}")
    experts = EXPERTS_PER_RANK * world
    xs, idxs, probs = [], [], []
    for r in range(world):
        g = torch.Generator().manual_seed(seed * 1000 + r)
        xs.append(torch.randn(TOKENS, HIDDEN, generator=g).bfloat16())
        idx = torch.stack([torch.randperm(experts, generator=g)[:TOPK] for _ in range(TOKENS)])
        idx[torch.rand(TOKENS, TOPK, generator=g) < 0.2] = -1
        idxs.append(idx)
        probs.append(torch.rand(TOKENS, TOPK, generator=g).masked_fill(idx < 0, 0))
    return xs, idxs, probs


def expert(recv_x: torch.Tensor, recv_idx: torch.Tensor, recv_probs: torch.Tensor) -> torch.Tensor:
    """A stand-in expert computation: a function of each received row alone, differentiable in x and in the
    probs of the row's local experts (the other slots are not this rank's)."""
    scale = torch.where(recv_idx >= 0, recv_probs * (recv_idx + 2), 0).sum(1, keepdim=True)
    return recv_x * scale.to(recv_x.dtype)


def reference_rank(world: int, seed: int, rank: int) -> dict[str, Any]:
    """This rank's dispatch outputs, combined rows and gradients by the reference (autograd through it)."""
    xs, idxs, probs = all_inputs(world, seed)
    xs = [x.clone().requires_grad_(r == rank) for r, x in enumerate(xs)]
    probs = [p.clone().requires_grad_(r == rank) for r, p in enumerate(probs)]
    received = reference_dispatch(xs, idxs, probs, EXPERTS_PER_RANK * world)
    ys = [expert(rec.x, rec.topk_idx, rec.topk_weights) for rec in received]
    combined = reference_combine(ys, received, [TOKENS] * world)[rank]
    loss_weights = torch.linspace(-1, 1, HIDDEN)
    (combined.float() * loss_weights).sum().backward()
    mine = received[rank]
    return {"recv_x": mine.x.detach(), "recv_idx": mine.topk_idx, "recv_probs": mine.topk_weights.detach(),
            "per_expert": mine.per_expert, "combined": combined.detach(), "x.grad": xs[rank].grad,
            "probs.grad": probs[rank].grad, "loss_weights": loss_weights}


def check(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    assert torch.equal(got["recv_x"], want["recv_x"]), f"{where}: recv_x"
    assert torch.equal(got["recv_idx"], want["recv_idx"]), f"{where}: recv topk_idx"
    assert torch.equal(got["recv_probs"], want["recv_probs"]), f"{where}: recv probs"
    assert list(got["per_expert"]) == want["per_expert"], f"{where}: tokens per expert"
    torch.testing.assert_close(got["combined"].float(), want["combined"].float(), rtol=1e-2, atol=1e-2,
                               msg=f"{where}: combined")
    for name in ("x.grad", "probs.grad"):
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=2e-2, atol=2e-2, msg=f"{where}: {name}")


# Megatron-core's fused_a2a, replayed.

class MegatronReplay:
    """get_buffer / FusedDispatch / FusedCombine / set_deepep_num_sms as fused_a2a makes their calls."""

    def __init__(self, deep_ep: Any) -> None:
        self.deep_ep, self.buffer = deep_ep, None
        replay = self

        class Dispatch(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, token_indices, token_probs, num_experts, group, async_finish=False,
                        allocate_on_comm_stream=False):
                EventOverlap, EventHandle = deep_ep.utils.EventOverlap, deep_ep.utils.EventHandle
                previous_event = EventOverlap(EventHandle()) if async_finish else None
                buffer = replay.get_buffer(group, x.size(1) * max(x.element_size(), 2))
                per_rank, per_rdma_rank, per_expert, in_rank, event = buffer.get_dispatch_layout(
                    token_indices, num_experts, previous_event=previous_event, async_finish=async_finish,
                    allocate_on_comm_stream=allocate_on_comm_stream)
                recv_x, recv_idx, recv_probs, counts, handle, after = buffer.dispatch(
                    x, topk_idx=token_indices, topk_weights=token_probs, num_tokens_per_rank=per_rank,
                    num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
                    num_tokens_per_expert=per_expert, previous_event=event, async_finish=async_finish,
                    allocate_on_comm_stream=allocate_on_comm_stream)
                if async_finish:
                    after.current_stream_wait()
                ctx.group, ctx.handle = group, handle
                ctx.async_finish, ctx.allocate_on_comm_stream = async_finish, allocate_on_comm_stream
                return recv_x, recv_idx, recv_probs, torch.tensor(counts), handle

            @staticmethod
            def backward(ctx, grad_output, grad_idx, grad_probs, grad_counts, grad_handle):
                EventOverlap, EventHandle = deep_ep.utils.EventOverlap, deep_ep.utils.EventHandle
                buffer = replay.get_buffer(ctx.group, grad_output.size(1) * max(grad_output.element_size(), 2))
                previous_event = EventOverlap(EventHandle()) if ctx.async_finish else None
                grad_x, grad_token_probs, after = buffer.combine(
                    grad_output.contiguous(), ctx.handle, topk_weights=grad_probs.float(),
                    previous_event=previous_event, async_finish=ctx.async_finish,
                    allocate_on_comm_stream=ctx.allocate_on_comm_stream)
                if ctx.async_finish:
                    after.current_stream_wait()
                return grad_x, None, grad_token_probs, None, None, None, None

        class Combine(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, group, handle, async_finish=False, allocate_on_comm_stream=False):
                EventOverlap, EventHandle = deep_ep.utils.EventOverlap, deep_ep.utils.EventHandle
                previous_event = EventOverlap(EventHandle()) if async_finish else None
                buffer = replay.get_buffer(group, x.size(1) * max(x.element_size(), 2))
                combined, _, after = buffer.combine(x, handle=handle, async_finish=async_finish,
                                                    previous_event=previous_event,
                                                    allocate_on_comm_stream=allocate_on_comm_stream)
                if async_finish:
                    after.current_stream_wait()
                ctx.handle, ctx.group = handle, group
                ctx.async_finish, ctx.allocate_on_comm_stream = async_finish, allocate_on_comm_stream
                return combined, None

            @staticmethod
            def backward(ctx, grad_output, _previous_event=None):
                EventOverlap, EventHandle = deep_ep.utils.EventOverlap, deep_ep.utils.EventHandle
                previous_event = EventOverlap(EventHandle()) if ctx.async_finish else None
                buffer = replay.get_buffer(ctx.group, grad_output.size(1) * max(grad_output.element_size(), 2))
                grad_x, _, _, _, _, after = buffer.dispatch(
                    grad_output.contiguous(), handle=ctx.handle, previous_event=previous_event,
                    async_finish=ctx.async_finish, allocate_on_comm_stream=ctx.allocate_on_comm_stream)
                if ctx.async_finish:
                    after.current_stream_wait()
                return grad_x, None, None, None, None

        self.Dispatch, self.Combine = Dispatch, Combine

    def get_buffer(self, group: Any, hidden_bytes: int) -> Any:
        Buffer = self.deep_ep.Buffer
        nvl, rdma = 0, 0
        for config in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())):
            nvl = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), nvl)
            rdma = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), rdma)
        b = self.buffer
        if b is None or b.group != group or b.num_nvl_bytes < nvl or b.num_rdma_bytes < rdma:
            self.buffer = Buffer(group, nvl, rdma)
        return self.buffer

    def fused_dispatch(self, x, token_indices, token_probs, num_experts, group, async_finish=False,
                       allocate_on_comm_stream=False):
        return self.Dispatch.apply(x.contiguous(), token_indices, token_probs, num_experts, group, async_finish,
                                   allocate_on_comm_stream)

    def fused_combine(self, x, group, handle, async_finish=False, allocate_on_comm_stream=False):
        return self.Combine.apply(x, group, handle, async_finish, allocate_on_comm_stream)

    def set_deepep_num_sms(self, num_sms: int) -> None:
        self.deep_ep.Buffer.set_num_sms(num_sms)


def run_megatron_style(a2a: Any, world: int, seed: int, async_finish: bool) -> dict[str, Any]:
    """One MoE layer's forward and backward through fused_dispatch / fused_combine (`a2a`: the replay or
    Megatron's own module), on this rank's inputs."""
    rank, group = dist.get_rank(), dist.group.WORLD
    xs, idxs, probs = all_inputs(world, seed)
    x, p = xs[rank].clone().requires_grad_(), probs[rank].clone().requires_grad_()
    a2a.set_deepep_num_sms(4)
    recv_x, recv_idx, recv_probs, counts, handle = a2a.fused_dispatch(x, idxs[rank], p, EXPERTS_PER_RANK * world,
                                                                     group, async_finish, async_finish)
    assert isinstance(handle, tuple) and len(handle) == (6 if world <= a2a_nvl_peers() else 10)
    combined, _ = a2a.fused_combine(expert(recv_x, recv_idx, recv_probs), group, handle, async_finish, async_finish)
    (combined.float() * torch.linspace(-1, 1, HIDDEN)).sum().backward()
    return {"recv_x": recv_x.detach(), "recv_idx": recv_idx, "recv_probs": recv_probs.detach(),
            "per_expert": counts.tolist(), "combined": combined.detach(), "x.grad": x.grad, "probs.grad": p.grad}


def a2a_nvl_peers() -> int:
    from kernels_cuda.deep_ep import config

    return config.NUM_MAX_NVL_PEERS


def megatron_replay_rank(world: int, nvl_peers: int, seed: int) -> str:
    with deep_ep_installed(nvl_peers) as deep_ep:
        replay = MegatronReplay(deep_ep)
        want = reference_rank(world, seed, dist.get_rank())
        for async_finish in (False, True):
            got = run_megatron_style(replay, world, seed, async_finish)
            check(got, want, f"rank {dist.get_rank()} async_finish={async_finish}")
        buffer = replay.get_buffer(dist.group.WORLD, HIDDEN * 2)
        assert buffer is replay.buffer and deep_ep.Buffer.num_sms == 4  # reused: big enough, same group
        assert (buffer.group_size, buffer.low_latency_mode, buffer.explicitly_destroy) == (world, False, False)
        assert buffer.num_rdma_bytes == 0 if world <= nvl_peers else buffer.num_rdma_bytes > 0
    return "ok"


def megatron_module_rank(world: int, nvl_peers: int, seed: int) -> str:
    """Megatron-core's own fused_a2a, imported after the alias and called unmodified."""
    with deep_ep_installed(nvl_peers):
        from megatron.core.transformer.moe import fused_a2a

        fused_a2a = importlib.reload(fused_a2a)  # its `from deep_ep import ...` binds to this alias
        want = reference_rank(world, seed, dist.get_rank())
        check(run_megatron_style(fused_a2a, world, seed, False), want, f"rank {dist.get_rank()}")
    return "ok"


# torchtitan's DeepEP dispatcher, replayed (its custom ops are registered for CUDA only, so the buffer
# calls inside them are made directly, in the order its forward and backward make them).

def torchtitan_replay_rank(world: int, nvl_peers: int, seed: int) -> str:
    rank, group = dist.get_rank(), dist.group.WORLD
    with deep_ep_installed(nvl_peers) as deep_ep:
        from deep_ep.utils import EventHandle, EventOverlap

        xs, idxs, probs = all_inputs(world, seed)
        x, scores = xs[rank], probs[rank]
        indices = idxs[rank].contiguous().masked_fill(scores == 0, -1)  # zero-score slots masked out
        want = reference_dispatch(xs, [i.masked_fill(p == 0, -1) for i, p in zip(idxs, probs)], probs,
                                  EXPERTS_PER_RANK * world)
        deep_ep.Buffer.set_num_sms(4)
        hidden_bytes = x.size(1) * max(x.element_size(), 2)
        Buffer = deep_ep.Buffer
        nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, group.size())
                  for c in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())))
        rdma = max(c.get_rdma_buffer_size_hint(hidden_bytes, group.size())
                   for c in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())))
        buffer = Buffer(group, nvl, rdma)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(
            topk_idx=indices, num_experts=EXPERTS_PER_RANK * world)
        recv_x, recv_idx, recv_scores, counts, handle, after = buffer.dispatch(
            x=x, topk_idx=indices, topk_weights=scores.to(torch.float32), num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            previous_event=EventOverlap(EventHandle()), async_finish=True, allocate_on_comm_stream=True)
        after.current_stream_wait()
        mine = want[rank]
        assert torch.equal(recv_x, mine.x) and torch.equal(recv_idx, mine.topk_idx), f"rank {rank}: dispatch"
        assert torch.equal(recv_scores, mine.topk_weights) and counts == mine.per_expert, f"rank {rank}: scores"
        ys = [expert(r.x, r.topk_idx, r.topk_weights) for r in want]
        combined, _, after = buffer.combine(x=ys[rank], handle=handle, previous_event=EventOverlap(EventHandle()),
                                            async_finish=True, allocate_on_comm_stream=True)
        after.current_stream_wait()  # torchtitan's sync_combine
        expect = reference_combine(ys, want, [TOKENS] * world)[rank]
        torch.testing.assert_close(combined.float(), expect.float(), rtol=1e-2, atol=1e-2)
        # backward of combine: a cached dispatch of the gradient, every layout argument None
        grads = [torch.full((TOKENS, HIDDEN), float(r + 1)).bfloat16() for r in range(world)]
        grad_x, _, _, _, _, after = buffer.dispatch(
            x=grads[rank], topk_idx=None, topk_weights=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
            is_token_in_rank=None, num_tokens_per_expert=None, handle=handle,
            previous_event=EventOverlap(EventHandle()), async_finish=True, allocate_on_comm_stream=True)
        after.current_stream_wait()
        assert torch.equal(grad_x, reference_dispatch(grads, idxs, probs, EXPERTS_PER_RANK * world)[rank].x)
        # backward of dispatch: a combine of the received rows' gradients with the scores' gradients
        grad_x, grad_scores, after = buffer.combine(
            x=recv_x, handle=handle, topk_weights=recv_scores.float(), previous_event=EventOverlap(EventHandle()),
            async_finish=True, allocate_on_comm_stream=True)
        after.current_stream_wait()
        torch.testing.assert_close(grad_x.float(), reference_combine([r.x for r in want], want, [TOKENS] * world)[rank]
                                   .float(), rtol=1e-2, atol=1e-2)
        assert torch.equal(grad_scores, scores), f"rank {rank}: each score comes back from exactly one rank"
    return "ok"


LAYOUTS = [(4, 8), (4, 2)]  # (world, GPUs per node): one node of 4, two simulated nodes of 2
LAYOUT_IDS = ["intranode-4", "internode-2x2"]


@pytest.mark.parametrize("world, nvl_peers", LAYOUTS, ids=LAYOUT_IDS)
def test_megatron_fused_a2a_call_sequence_runs_on_our_buffer(pools, kernels_cpu, world, nvl_peers):
    assert pools.get(world).run(megatron_replay_rank, world, nvl_peers, 71, deadline_s=180) == ["ok"] * world


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                    reason="megatron-core is not installed here; the replay above makes its calls")
def test_megatron_fused_a2a_itself_runs_on_our_buffer(pools, kernels_cpu):
    assert pools.get(4).run(megatron_module_rank, 4, 8, 72, deadline_s=180) == ["ok"] * 4


@pytest.mark.parametrize("world, nvl_peers", LAYOUTS, ids=LAYOUT_IDS)
def test_torchtitan_deepep_call_sequence_runs_on_our_buffer(pools, kernels_cpu, world, nvl_peers):
    assert pools.get(world).run(torchtitan_replay_rank, world, nvl_peers, 73, deadline_s=180) == ["ok"] * world
