"""Which GEMMs of a bf16 training step run in bf16: the share of GEMM FLOPs, and the fp32 ones.

`GemmCensus`, a TorchDispatchMode, records every GEMM and attention kernel that reaches ATen
(mm, addmm, bmm, baddbmm, `_grouped_mm`, the SDPA kernels; `matmul` and `linear` arrive as
these): its operand dtypes, its FLOPs and the innermost module running it, in forward and
backward. The script prints the bf16 share of one forward+backward of a config's model with bf16
parameters (what `train.precision=bf16` trains: `parallel.mixed_precision`), through plain autograd
and through the pipeline's split backward (B, then W), and lists every GEMM that is not bf16.

    python -m benchmarks.gemm_precision [--config moe_train/configs/demo.yaml] [--batch 8] [--seq 256]
"""
from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.module_tracker import ModuleTracker

from model.transformer import DeepSeekV3
from moe_train.config import load_config
from parallel.data_parallel import build_buffers
from parallel.mixed_precision import zero_grad_buffers
from parallel.pipeline.ir import ActionKind
from parallel.pipeline.wgrad import SplitGemmOps, WeightGradStore

aten = torch.ops.aten


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor) -> int:
    """2D x 3D ([M, K] x [G, K, N], rows grouped) and 2D x 2D ([N, M] x [M, K], the reduction grouped)
    both cost 2 M K N; 3D x 3D is a batched matmul."""
    if a.dim() == 3 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    if a.dim() == 2 and b.dim() in (2, 3):
        return 2 * a.shape[0] * a.shape[1] * b.shape[-1]
    raise NotImplementedError(f"_grouped_mm of {a.dim()}D x {b.dim()}D operands")


def _registry(packet: Any) -> Callable[..., int]:
    def flops(*args: Any, out: Any, **kwargs: Any) -> int:
        return flop_registry[packet](*args, out_val=out, **kwargs)
    return flops


# kernel -> (FLOPs of a call, positions of its operands among the arguments)
KERNELS: dict[Any, tuple[Callable[..., int], tuple[int, ...]]] = {
    aten.mm: (_registry(aten.mm), (0, 1)),
    aten.bmm: (_registry(aten.bmm), (0, 1)),
    aten.addmm: (_registry(aten.addmm), (1, 2)),
    aten.baddbmm: (_registry(aten.baddbmm), (1, 2)),
    aten._grouped_mm: (lambda a, b, *args, out, **kwargs: _grouped_mm_flops(a, b), (0, 1)),
    aten._scaled_dot_product_flash_attention_for_cpu: (
        lambda q, k, v, *args, out, **kwargs: sdpa_flop_count(q.shape, k.shape, v.shape), (0, 1, 2)),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        lambda grad, q, k, v, *args, out, **kwargs: sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape),
        (0, 1, 2, 3)),
    **{packet: (_registry(packet), positions) for packet, positions in (
        (aten._scaled_dot_product_flash_attention, (0, 1, 2)),
        (aten._scaled_dot_product_efficient_attention, (0, 1, 2)),
        (aten._scaled_dot_product_cudnn_attention, (0, 1, 2)),
        (aten._scaled_dot_product_flash_attention_backward, (0, 1, 2, 3)),
        (aten._scaled_dot_product_efficient_attention_backward, (0, 1, 2, 3)),
        (aten._scaled_dot_product_cudnn_attention_backward, (0, 1, 2, 3)),
    )},
}


@dataclass(frozen=True)
class GemmCall:
    kernel: str  # e.g. "mm", "_grouped_mm"
    module: str  # innermost module running it, named as in the model's named_modules()
    dtypes: tuple[torch.dtype, ...]  # of the operands
    flops: int
    phase: str  # "forward", "backward" or "W" (deferred weight-gradient work, run after the backward)


class GemmCensus(TorchDispatchMode):
    """Records a `GemmCall` per GEMM/attention kernel while active; modules are tracked through
    the `tracker` (a `ModuleTracker` entered around the same code)."""

    def __init__(self, tracker: ModuleTracker) -> None:
        super().__init__()
        self.tracker = tracker
        self.calls: list[GemmCall] = []
        self._owners: dict[int, str] = {}  # autograd node sequence number -> module whose forward made it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kernel = KERNELS.get(func.overloadpacket)
        if kernel is not None:
            flops, positions = kernel
            node = torch._C._current_autograd_node()
            module, phase = self._module(node)
            self.calls.append(GemmCall(func.overloadpacket.__name__, module, tuple(args[i].dtype for i in positions),
                                       int(flops(*args, out=out, **kwargs)), phase))
        return out

    def _module(self, node: torch.autograd.graph.Node | None) -> tuple[str, str]:
        """(module, phase). In backward, the module whose forward created the running autograd node; in forward,
        the deepest running module (the tracker's names without their root prefix, the class name).

        The tracker alone cannot tell in backward: a module stays "running" there until the
        gradient of all its inputs is complete, so the router and the shared expert, which read
        the same input, overlap. An autograd node is created just before its kernel is
        dispatched, so in forward the latest sequence number is this GEMM's node (or, inside a
        custom Function's forward, the Function's node).
        """
        if node is not None:
            return self._owners.get(node._sequence_nr(), f"<unknown: {node.name()}>"), "backward"
        running = self.tracker.parents - {"Global"}
        if not running:
            return "<deferred>", "W"
        module = max(running, key=lambda name: name.count(".")).partition(".")[2]
        self._owners[torch._C._autograd._get_sequence_nr() - 1] = module
        return module, "forward"

    def flops(self, dtype: torch.dtype | None = None) -> int:
        """FLOPs of all calls, or of those whose operands are all `dtype`."""
        return sum(c.flops for c in self.calls if dtype is None or set(c.dtypes) == {dtype})

    def share(self, dtype: torch.dtype = torch.bfloat16) -> float:
        return self.flops(dtype) / self.flops()

    def other_than(self, dtype: torch.dtype = torch.bfloat16) -> dict[tuple[str, str], int]:
        """FLOPs by (module, kernel) of the calls with an operand not in `dtype`."""
        found: dict[tuple[str, str], int] = defaultdict(int)
        for call in self.calls:
            if set(call.dtypes) != {dtype}:
                found[(call.module, call.kernel)] += call.flops
        return dict(found)


def census_step(model: DeepSeekV3, input_ids: torch.Tensor, labels: torch.Tensor) -> GemmCensus:
    """One forward+backward of `model` in its parameters' precision, recorded: plain autograd, or,
    where the model's GEMMs are split (`SplitGemmOps`), a B scope, then its W. Gradients are left in
    the gradient buffers (`.grad`, or the main grads of bf16 parameters), zeroed first."""
    zero_grad_buffers(model.parameters())

    def loss() -> torch.Tensor:
        return model(input_ids, labels, aux_grad_scale=1.0).loss

    with ModuleTracker() as tracker, GemmCensus(tracker) as census:
        if isinstance(model.gemms, SplitGemmOps):
            store = model.gemms.store
            out = loss()
            with store.scope(0, 0, ActionKind.B):
                out.backward()
            store.run_w(0, 0)
        else:
            loss().backward()
    return census


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="moe_train/configs/demo.yaml")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    print(f"seed {opts.seed}")
    torch.manual_seed(opts.seed)
    args = load_config(opts.config).model
    model = DeepSeekV3(args).train()
    split_model = DeepSeekV3(args, gemms=SplitGemmOps(WeightGradStore())).train()
    split_model.load_state_dict(model.state_dict())
    for bf16_model in (model, split_model):
        build_buffers(bf16_model, None, torch.bfloat16, shard=False)
    ids = torch.randint(0, args.vocab_size, (opts.batch, opts.seq + 1))
    print(f"config {opts.config}, batch {opts.batch} x seq {opts.seq}, forward+backward with bf16 parameters")
    for split, stepped in ((False, model), (True, split_model)):
        census = census_step(stepped, ids[:, :-1], ids[:, 1:])
        print(f"{'split backward (B, W)' if split else 'autograd':22s} bf16 share of GEMM FLOPs: "
              f"{census.share():.1%} of {census.flops() / 1e9:.2f} GFLOP")
        for (module, kernel), flops in sorted(census.other_than().items()):
            print(f"    not bf16: {module} {kernel}: {flops / census.flops():.2%}")


if __name__ == "__main__":
    main()
