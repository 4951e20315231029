"""The FP8 GEMMs' path through torch's blockwise `scaled_mm` (model/fp8.py), on CPU: torch's CPU build
refuses blockwise scales, so a stand-in takes the kernel's place. The stand-in holds the contract
torch's CUDA kernel checks (aten's scaled BLAS: E4M3 operands, `mat_a` row-major [M, K] and `mat_b`
column-major [K, N] with K and N multiples of 16; a 1x128 scale [rows, ceil(K/128)] fp32 column-major;
a 128x128 scale [ceil(K/128) rounded up to 4, ceil(N/128)] fp32 column-major) plus the 16-row
multiple the code assumes, and computes the product from that contract alone: each operand
dequantized with the scales as the layout places them, one fp32 GEMM per 128 of K, called as the
emulation calls it, so that the same operands give the same bits.

What this checks: the operands and scales the GEMMs hand the kernel are laid out as the kernel reads
them (a transposed weight, the Dgrad's, included), the grouped GEMMs run one kernel GEMM per
non-empty group with its rows padded, and every GEMM, forward and both gradients, dense and grouped,
equals the emulation the CPU runs otherwise. Whether the real kernel agrees is for the GPU run
(`tests/gpu/run_gpu_checks.sh`; its start-up probe compares the kernel with the emulation).
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import model.fp8
from model.fp8 import Fp8GemmOps, blockwise_scaled_mm_supported
from model.layers import GroupEnds, GroupedLinear, Linear
from model.moe import RoutedExperts
from model.recompute import Recompute
from tests.host_syncs import HostSyncCounter
from tests.unit.test_fp8 import GROUP_SIZES, generator, group_ends, group_offsets, swiglu, tiled_randn

TILE = 128


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def column_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and (t.stride(1) == t.shape[0] or t.shape[1] == 1)


class KernelStandIn:
    """`F.scaled_mm` for the blockwise recipes, from the contract in the module docstring; records the
    (M, K, N, recipe of b) of every call."""

    def __init__(self, misplace_scales: bool = False) -> None:
        self.calls: list[tuple[int, int, int, str]] = []
        self.misplace_scales = misplace_scales

    def __call__(self, mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: torch.Tensor, recipe_a, scale_b: torch.Tensor,
                 recipe_b, swizzle_a=None, swizzle_b=None, bias=None, output_dtype=torch.bfloat16,
                 contraction_dim=(), use_fast_accum=False) -> torch.Tensor:
        scaling = F.ScalingType
        assert mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn
        (m, k), (k_b, n) = mat_a.shape, mat_b.shape
        assert k == k_b and k % 16 == 0 and n % 16 == 0 and m % 16 == 0, (mat_a.shape, mat_b.shape)
        assert mat_a.stride(1) == 1 and mat_a.stride(0) == k, "mat_a must be row-major"
        assert mat_b.stride(0) == 1 and mat_b.stride(1) == k, "mat_b must be column-major"
        k_blocks = ceil_div(k, TILE)
        assert recipe_a == scaling.BlockWise1x128 and scale_a.dtype == torch.float32
        assert scale_a.shape == (m, k_blocks) and column_major(scale_a), (scale_a.shape, scale_a.stride())
        a_scales = scale_a.repeat_interleave(TILE, 1)[:, :k]  # [M, K]
        if recipe_b == scaling.BlockWise128x128:
            assert scale_b.shape == (ceil_div(k_blocks, 4) * 4, ceil_div(n, TILE)) and column_major(scale_b)
            b_scales = scale_b[:k_blocks].repeat_interleave(TILE, 0)[:k].repeat_interleave(TILE, 1)[:, :n]
        else:
            assert recipe_b == scaling.BlockWise1x128
            assert scale_b.shape == (n, k_blocks) and column_major(scale_b), (scale_b.shape, scale_b.stride())
            b_scales = scale_b.t().repeat_interleave(TILE, 0)[:k]  # [K, N]
        assert scale_b.dtype == torch.float32
        if self.misplace_scales:
            a_scales = a_scales.flip(0)
        self.calls.append((m, k, n, "128x128" if recipe_b == scaling.BlockWise128x128 else "1x128"))
        a, b_t = mat_a.float() * a_scales, (mat_b.float() * b_scales).t().contiguous()  # b_t: [N, K]
        out = torch.zeros(m, n)
        for start in range(0, k, TILE):
            out += a[:, start:start + TILE].contiguous() @ b_t[:, start:start + TILE].contiguous().t()
        return out.to(output_dtype)


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch):
    """The stand-in in torch's place, probed already (its calls forgotten); the probe's cached answers are
    dropped before and after."""
    stand_in = KernelStandIn()
    monkeypatch.setattr(F, "scaled_mm", stand_in)
    model.fp8._probe_blockwise_kernel.cache_clear()
    assert blockwise_scaled_mm_supported("cpu") and blockwise_scaled_mm_supported("cpu", torch.float32)
    stand_in.calls.clear()
    yield stand_in
    model.fp8._probe_blockwise_kernel.cache_clear()


def test_the_probe_tries_both_recipes_and_refuses_a_kernel_misreading_scales(kernel, monkeypatch):
    model.fp8._probe_blockwise_kernel.cache_clear()
    assert blockwise_scaled_mm_supported("cpu", torch.float32)
    assert sorted(kernel.calls) == [(128, 256, 256, "128x128")] * 2 + [(128, 256, 256, "1x128")]
    monkeypatch.setattr(F, "scaled_mm", KernelStandIn(misplace_scales=True))
    model.fp8._probe_blockwise_kernel.cache_clear()
    assert not blockwise_scaled_mm_supported("cpu")


def run_linear(seed: int, in_features: int, out_features: int, rows: int) -> tuple[torch.Tensor, ...]:
    gen = generator(seed)
    layer = Linear(in_features, out_features, 0.02)
    layer.gemms = Fp8GemmOps()
    layer.weight.data = tiled_randn((out_features, in_features), gen)
    x = tiled_randn((rows, in_features), gen).requires_grad_()
    y = layer(x)
    y.backward(tiled_randn((rows, out_features), gen))
    return y.detach(), x.grad, layer.weight.grad


def fp8_grouped_layer(gen: torch.Generator, in_features: int, out_features: int) -> GroupedLinear:
    """A GroupedLinear of GROUP_SIZES' groups on FP8 GEMMs, its weights drawn from `gen`."""
    layer = GroupedLinear(len(GROUP_SIZES), in_features, out_features)
    layer.gemms = Fp8GemmOps()
    layer.weight.data = torch.stack([tiled_randn((out_features, in_features), gen) for _ in GROUP_SIZES])
    return layer


def run_grouped(seed: int, in_features: int, out_features: int) -> tuple[torch.Tensor, ...]:
    gen = generator(seed)
    layer = fp8_grouped_layer(gen, in_features, out_features)
    x = tiled_randn((sum(GROUP_SIZES), in_features), gen).requires_grad_()
    y = layer(x, group_ends(GROUP_SIZES))
    y.backward(tiled_randn((sum(GROUP_SIZES), out_features), gen))
    return y.detach(), x.grad, layer.weight.grad


def run_activated(seed: int, width: int, out_features: int) -> tuple[torch.Tensor, ...]:
    gen = generator(seed)
    layer = fp8_grouped_layer(gen, width, out_features)
    rows = sum(GROUP_SIZES)
    x = tiled_randn((rows, 2 * width), gen, spread=3).requires_grad_()
    row_weights = (torch.rand(rows, 1, generator=gen) + 0.5).requires_grad_()
    y = layer.forward_activated(swiglu, x, row_weights, group_ends(GROUP_SIZES), Recompute(()))
    y.backward(tiled_randn((rows, out_features), gen))
    return y.detach(), x.grad, row_weights.grad, layer.weight.grad


def through_kernel_and_emulated(run: functools.partial, kernel: KernelStandIn,
                                monkeypatch: pytest.MonkeyPatch) -> tuple[tuple[torch.Tensor, ...], ...]:
    """`run()` with the stand-in as torch's kernel, then with the CPU build's own `scaled_mm` (which
    refuses blockwise scales: the emulation runs)."""
    through_kernel = run()
    monkeypatch.undo()
    model.fp8._probe_blockwise_kernel.cache_clear()
    assert not blockwise_scaled_mm_supported("cpu")
    return through_kernel, run()


def assert_same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], exact: bool) -> None:
    """The kernel path's outputs and gradients are the emulation's: bit for bit where both make the same
    fp32 GEMM calls (the dense GEMMs), else up to the order of the fp32 sums (the grouped emulation sums
    through `grouped_mm` over unpadded groups, the kernel path over padded per-group GEMMs)."""
    for index, (g, w) in enumerate(zip(got, want)):
        relative = ((g - w).abs().max() / w.abs().max()).item()
        print(f"output {index}: max |kernel path - emulation| / max |emulation| = {relative:.3g}")
        assert g.dtype == w.dtype
        assert torch.equal(g, w) if exact else relative <= 2 ** -20


def test_dense_gemms_run_the_kernel_and_equal_the_emulation(kernel, monkeypatch):
    """Fprop (1x128 x 128x128), Dgrad (the transposed FP8 weight) and Wgrad (1x128 x 1x128, fp32 out)."""
    got, want = through_kernel_and_emulated(functools.partial(run_linear, 50, 256, 384, 256), kernel, monkeypatch)
    assert kernel.calls == [(256, 256, 384, "128x128"), (256, 384, 256, "128x128"), (384, 256, 256, "1x128")]
    assert_same(got, want, exact=True)


def test_grouped_gemms_run_one_kernel_gemm_per_group_and_equal_the_emulation(kernel, monkeypatch):
    """Groups of 9, 0, 160 and 71 rows: three kernel GEMMs each for Fprop, Dgrad and Wgrad (none for the
    empty group, whose weight gradient stays zero), the rows padded to 16 (9 -> 16, 160, 71 -> 80); the
    Wgrad contracts over each group's 128-row tiles (1, 2 and 1 tiles, and the last group's GEMM also
    the all-zero tile past the groups: 5 tiles is the static bound (240 + 4 x 127) // 128)."""
    got, want = through_kernel_and_emulated(functools.partial(run_grouped, 51, 256, 384), kernel, monkeypatch)
    assert kernel.calls == [(16, 256, 384, "128x128"), (160, 256, 384, "128x128"), (80, 256, 384, "128x128"),
                             (16, 384, 256, "128x128"), (160, 384, 256, "128x128"), (80, 384, 256, "128x128"),
                             (384, 128, 256, "1x128"), (384, 256, 256, "1x128"), (384, 256, 256, "1x128")]
    assert not got[2][1].any()
    assert_same(got, want, exact=False)


def test_the_experts_activated_down_projection_runs_the_kernel_and_equals_the_emulation(kernel, monkeypatch):
    """The SwiGLU input cached in FP8 and the SwiGLU rebuilt in backward, with its GEMMs on the kernel."""
    got, want = through_kernel_and_emulated(functools.partial(run_activated, 52, 256, 128), kernel, monkeypatch)
    assert len(kernel.calls) == 9
    assert_same(got, want, exact=False)


def test_shapes_the_kernel_does_not_take_are_emulated(kernel):
    """K = 200 (not whole 128-wide tiles), 48 rows (the Wgrad's K) and a 144-row weight (not whole
    128-row blocks) are emulated; the 144-row weight's gradient, 1x128 x 1x128 tiles over the groups'
    rows, runs the kernel."""
    run_linear(53, 200, 256, 48)
    assert not kernel.calls
    run_grouped(54, 256, 144)
    assert [call[3] for call in kernel.calls] == ["1x128"] * 3


def run_experts(seed: int, dim: int, hidden: int, tokens: int, counted: bool) -> HostSyncCounter:
    """The routed experts, forward and backward, top-2 over 4 local experts, their host syncs counted;
    `counted`: with slots of other ranks' experts (-1) and the slots per expert given, as an EP dispatcher
    delivers them; else every slot local, as the one-process dispatcher's."""
    gen = generator(seed)
    experts = RoutedExperts(4, dim, hidden, 0.02)
    experts.gate_up_proj.gemms = experts.down_proj.gemms = Fp8GemmOps()
    x = tiled_randn((tokens, dim), gen).requires_grad_()
    local_idx = torch.randint(-1 if counted else 0, 4, (tokens, 2), generator=gen)
    weights = torch.rand(tokens, 2, generator=gen)
    grad = tiled_randn((tokens, dim), gen)
    per_expert = [int((local_idx == e).sum()) for e in range(4)] if counted else None
    with HostSyncCounter() as syncs:
        experts(x, local_idx, weights, per_expert).backward(grad)
    print(syncs.report())
    return syncs


def test_the_experts_read_their_group_sizes_to_the_host_once(kernel):
    """A MoE layer's six grouped GEMMs on the kernel (Fprop, Dgrad and Wgrad of gate/up and of down) loop
    over the experts on the host; they share one GroupEnds, so the group ends cross to the host once per
    layer and micro-batch (one synchronisation on a GPU), not once per GEMM; and not at all where the
    dispatcher gave the slots per expert (every EP dispatcher counts them on the host)."""
    syncs = run_experts(55, 256, 128, 96, counted=False)
    assert len(kernel.calls) >= 12
    assert [(s.kind, s.where.split(":")[0]) for s in syncs.syncs] == [("tolist", "model/layers.py")]
    kernel.calls.clear()
    syncs = run_experts(55, 256, 128, 96, counted=True)
    assert len(kernel.calls) >= 12 and syncs.syncs == []


def test_group_ends_refuse_host_counts_of_another_length():
    with pytest.raises(ValueError, match="3 host counts for 4 groups"):
        GroupEnds(group_offsets(GROUP_SIZES), [1, 2, 3])
