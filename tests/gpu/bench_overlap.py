"""FB pair of a DeepSeek-V3-proxy MoE layer on one GPU, in turn and overlapped (`FBOverlap`).

The layer is the proxy config's (moe_train/configs/dsv3_proxy_h200.yaml), bf16, one 4096-token
sequence, all experts local. Its EP traffic is the emulated native dispatcher's: at each dispatch
and combine, forward and backward, an emulated 8-rank dispatch or combine of the layer's tokens
runs on the communication stream with `--comm-sms` SMs, and the chunk completes it through
the pair's `OverlapSwitch` (`parallel.dispatch.handles`), exactly where a real backend does. Prints times; asserts
nothing about them.

Run: python -m tests.gpu.bench_overlap [--comm-sms 20]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kernels_cuda import Config, EmulatedGroup
from model.block import DecoderLayer
from model.dispatcher import LocalDispatcher
from model.rope import RotaryEmbedding
from moe_train.config import load_config
from parallel.dispatch.handles import OverlapSwitch, StreamHandle
from parallel.pipeline.overlap import FBOverlap
from tests.kernels.cases import payload, routing, weights

RANKS, TOKENS = 8, 4096
ROOT = Path(__file__).resolve().parents[2]


class EmulatedTraffic:
    """One emulated dispatch or combine of the layer's tokens per call, on the comm stream if any."""

    def __init__(self, hidden: int, topk: int, experts: int, sms: int, switch: OverlapSwitch) -> None:
        self.switch = switch
        config = Config(num_sms=sms)
        self.group = EmulatedGroup(RANKS, config.buffer_size_hint(RANKS, hidden * 2, topk), config)
        self.topk, self.experts = routing("random", RANKS, TOKENS // RANKS, experts, topk, 0), experts
        self.xs = payload("random", RANKS, TOKENS // RANKS, hidden, torch.bfloat16, 0)
        self.ws = weights(RANKS, TOKENS // RANKS, topk, 0)
        result = self.group.dispatch(self.xs, self.topk, self.ws, experts)
        self.handles, self.ys = [r[4] for r in result], [r[0] for r in result]

    def move(self, combine: bool) -> None:
        stream = self.switch.comm_stream(torch.device("cuda"))
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            if combine:
                self.group.combine(self.ys, self.handles)
            else:
                self.group.dispatch(self.xs, handles=self.handles)
            event = torch.cuda.Event()
            event.record()
        self.switch.complete(StreamHandle(None, event))


class _Traffic(torch.autograd.Function):
    """Identity whose forward and backward each move the layer's tokens once."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, traffic: EmulatedTraffic, combine: bool) -> torch.Tensor:
        ctx.traffic, ctx.combine = traffic, combine
        traffic.move(combine)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.traffic.move(not ctx.combine)
        return grad, None, None


class TrafficDispatcher(LocalDispatcher):
    def __init__(self, traffic: EmulatedTraffic) -> None:
        self.traffic = traffic

    def dispatch(self, x, topk_idx, topk_weights, layout):
        return super().dispatch(_Traffic.apply(x, self.traffic, False), topk_idx, topk_weights, layout)

    def combine(self, y, handle):
        return _Traffic.apply(y, self.traffic, True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--comm-sms", type=int, default=20)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    model = load_config(ROOT / "moe_train/configs/dsv3_proxy_h200.yaml").model
    switch = OverlapSwitch()
    traffic = EmulatedTraffic(model.hidden_size, model.moe_router_topk, model.num_moe_experts, args.comm_sms, switch)
    layer = DecoderLayer(model, moe=True, dispatcher=TrafficDispatcher(traffic)).cuda()
    cos, sin = RotaryEmbedding(model).cuda()(TOKENS, torch.device("cuda"))
    x = [torch.randn(1, TOKENS, model.hidden_size, device="cuda", requires_grad=True) for _ in range(2)]

    def forward(i: int) -> torch.Tensor:
        with torch.autocast("cuda", torch.bfloat16):
            return layer(x[i], cos, sin)

    pending = {"out": forward(1)}

    def pair(hook: FBOverlap | None) -> None:
        """Forward of a fresh micro-batch with the backward of the previous pair's forward."""
        out = pending["out"]

        def forward_chunk() -> None:
            pending["out"] = forward(0)

        def backward_chunk() -> None:
            out.backward(torch.ones_like(out))

        if hook is None:
            forward_chunk()
            backward_chunk()
        else:
            hook(forward_chunk, backward_chunk)

    for name, hook in (("in turn", None), ("overlapped", FBOverlap(switch))):
        pair(hook)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            pair(hook)
        end.record()
        torch.cuda.synchronize()
        print(f"proxy MoE layer FB pair, {TOKENS} tokens, emulated EP{RANKS} traffic on {args.comm_sms} SMs: "
              f"{name:10} {start.elapsed_time(end) / args.iters:8.2f} ms")


if __name__ == "__main__":
    main()
