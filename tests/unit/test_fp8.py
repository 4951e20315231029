"""FP8 numerics of model/fp8.py: the E4M3 quantizer against an independent reference, and the FP8
GEMMs (forward, input gradient, weight gradient; dense and grouped) against float64 math.

The reference quantizer decodes all 256 E4M3 bit patterns by hand (sign, exponent, mantissa) and
rounds to the nearest table value, ties to the even code. It follows the quantizer's spec: the scale
is the tile's amax / 448 rounded to fp32 (1 for an all-zero tile, at least 2^-126), optionally
rounded up to a power of two; a value is the fp32 quotient value / scale, clamped to +-448.

GEMM bound. An E4M3 value has 4 significant bits, so quantizing v with its tile's scale s errs by at
most half a step: u(v) = max(2^-4 |v|, 2^-10 s) (2^-10 s for the subnormals below 2^-6 s), plus
2^-22 |v| for the fp32 roundings of the quotient and of the dequantized value. For out = A B^T
contracted over K, with the sums in fp32 (at most K + 2 roundings of 2^-24 each)::

    |out - A B^T| <= sum_k (u(a) |b| + |a| u(b) + u(a) u(b)) + (K + 2) 2^-24 sum_k (|a| + u(a)) (|b| + u(b))

Without subnormals this is c 2^-4 sum_k |a| |b| with c = 2 + 2^-4 + O(K 2^-20). The worst error
measured, printed as a multiple of 2^-4 sum_k |a| |b|, is about 1 (half the bound): the operands'
magnitudes change by powers of two from tile to tile, so a few products dominate a sum and their
rounding errors do not average out.
A second check is tight: the output equals the float64 product of the reference-quantized operands
within the fp32 accumulation term alone, which catches a wrong tiling or a low-precision accumulation.
"""
import math
import random
import struct

import pytest
import torch

import model.fp8 as fp8

import model.fp8
from model.fp8 import (E4M3_MAX, FP8_DTYPE, Fp8GemmOps, Fp8Tensor, blockwise_scaled_mm_supported,
                       emulated_fp8_mm, fp8_grouped_mm, fp8_grouped_weight_grad, fp8_mm, quantize_1x128,
                       quantize_128x1, quantize_128x1_grouped, quantize_128x128, quantize_tiles)
from model.layers import GroupEnds, GroupedLinear, Linear, packed_swiglu
from model.recompute import Recompute
from tests.unit.live_memory import LiveStorage

TILE = 128


def generator(seed: int) -> torch.Generator:
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def tiled_randn(shape: tuple[int, int], gen: torch.Generator, spread: int = 6) -> torch.Tensor:
    """Gaussian values whose magnitude changes by powers of two every 16 rows x 64 columns, so that
    tiles of every tiling have different scales (a misplaced scale shows)."""
    rows, cols = shape
    exponents = torch.randint(-spread, spread + 1, (-(-rows // 16), -(-cols // 64)), generator=gen)
    magnitudes = torch.exp2(exponents.float()).repeat_interleave(16, 0)[:rows].repeat_interleave(64, 1)[:, :cols]
    return torch.randn(rows, cols, generator=gen) * magnitudes


# ---- the independent reference quantizer ----

def e4m3_table() -> torch.Tensor:
    """The value of every E4M3 (fn) bit pattern: 1 sign, 4 exponent (bias 7), 3 mantissa bits; exponent 0
    is subnormal; S.1111.111 is NaN (there is no infinity)."""
    values = []
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent, mantissa = (code >> 3) & 0xF, code & 0x7
        if exponent == 0xF and mantissa == 0x7:
            values.append(math.nan)
        elif exponent == 0:
            values.append(sign * mantissa / 8 * 2.0 ** -6)
        else:
            values.append(sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return torch.tensor(values, dtype=torch.float64)


E4M3 = e4m3_table()
NON_NEGATIVE = E4M3[:0x7F]  # codes 0x00 .. 0x7E: 0 .. 448, ascending


def test_e4m3_table_is_the_format():
    assert NON_NEGATIVE[-1] == E4M3_MAX and NON_NEGATIVE[1] == 2.0 ** -9
    assert bool((NON_NEGATIVE.diff() > 0).all())
    # torch's decoding of every finite bit pattern agrees with the table
    codes = torch.arange(256, dtype=torch.uint8)
    decoded = codes.view(FP8_DTYPE).double()
    finite = ~E4M3.isnan()
    assert torch.equal(decoded[finite], E4M3[finite]) and bool(decoded[~finite].isnan().all())


def round_to_e4m3(values: torch.Tensor) -> torch.Tensor:
    """float64 values within +-448 -> the code of the nearest E4M3 value, ties to the even code."""
    magnitude = values.abs().contiguous()
    upper = torch.searchsorted(NON_NEGATIVE, magnitude).clamp(max=0x7E)  # first table value >= magnitude
    lower = (upper - 1).clamp(min=0)
    above, below = NON_NEGATIVE[upper] - magnitude, magnitude - NON_NEGATIVE[lower]
    take_upper = (above < below) | ((above == below) & (upper % 2 == 0))
    code = torch.where(take_upper, upper, lower) | (torch.signbit(values).long() << 7)
    return code.to(torch.uint8)


def to_fp32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def reference_scale(amax: float, power_of_two: bool) -> float:
    scale = 1.0 if amax == 0 else max(to_fp32(amax / 448), 2.0 ** -126)
    return 2.0 ** math.ceil(math.log2(scale)) if power_of_two else scale


class Reference:
    """x [R, C] quantized by the spec, in float64: codes [R, C], tile scales, the scale of every
    element, and the dequantized values."""

    def __init__(self, x: torch.Tensor, block_rows: int, power_of_two: bool = False) -> None:
        v = x.double()
        rows, cols = v.shape
        self.scales = torch.empty(-(-rows // block_rows), -(-cols // TILE), dtype=torch.float64)
        self.element_scales = torch.empty_like(v)
        for i in range(self.scales.shape[0]):
            for j in range(self.scales.shape[1]):
                tile = (slice(i * block_rows, (i + 1) * block_rows), slice(j * TILE, (j + 1) * TILE))
                self.scales[i, j] = reference_scale(v[tile].abs().max().item(), power_of_two)
                self.element_scales[tile] = self.scales[i, j]
        quotient = (v / self.element_scales).float().double()  # an fp32 division, as the spec says
        self.codes = round_to_e4m3(quotient.clamp(-E4M3_MAX, E4M3_MAX))
        self.values = E4M3[self.codes.long()] * self.element_scales

    def error_bound(self, v: torch.Tensor) -> torch.Tensor:
        """|dequantized - v| per element (the module docstring's u)."""
        v = v.double().abs()
        return torch.maximum(2.0 ** -4 * v, 2.0 ** -10 * self.element_scales) + 2.0 ** -22 * v


def codes(q: Fp8Tensor) -> torch.Tensor:
    return q.data.view(torch.uint8)


def assert_matches_reference(q: Fp8Tensor, ref: Reference) -> None:
    assert q.data.dtype == FP8_DTYPE and q.scale.dtype == torch.float32
    assert torch.equal(q.scale.double(), ref.scales)
    mismatch = codes(q) != ref.codes
    assert not mismatch.any(), (f"{int(mismatch.sum())} codes differ, first at {mismatch.nonzero()[0].tolist()}: "
                                f"{codes(q)[mismatch][:5].tolist()} vs reference {ref.codes[mismatch][:5].tolist()}")


# ---- the quantizer ----

TILINGS = {"1x128": (quantize_1x128, 1, False), "128x128": (quantize_128x128, TILE, False),
           "128x1": (quantize_128x1, 1, True)}  # quantizer, the reference's block rows, transposed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("power_of_two", [False, True], ids=["amax-scale", "pow2-scale"])
@pytest.mark.parametrize("tiling", list(TILINGS))
def test_quantizer_is_bit_exact(tiling, power_of_two, dtype):
    """Random tiles over 2^-30 .. 2^30, shapes not a multiple of 128, rows 0..127 x columns 0..127
    all zero (a whole tile in every tiling): scales and codes equal the reference bit for bit."""
    quantize, block_rows, transposed = TILINGS[tiling]
    gen = generator(100 + list(TILINGS).index(tiling) + 10 * power_of_two)
    x = tiled_randn((150, 300), gen, spread=30).to(dtype)
    x[:TILE, :TILE] = 0
    q = quantize(x, power_of_two)
    ref = Reference(x.t() if transposed else x, block_rows, power_of_two)
    assert_matches_reference(q, ref)
    subnormal = (codes(q) & 0x78 == 0) & (codes(q) & 0x07 != 0)
    assert subnormal.any(), "the random tiles should reach E4M3's subnormals"
    zero_tile_scales = q.scale[:1, :1] if tiling == "128x128" else q.scale[:TILE, :1]
    assert bool((zero_tile_scales == 1).all())


@pytest.mark.parametrize("tiling", list(TILINGS))
def test_quantizer_in_chunks_is_bit_exact_and_bounds_its_temporaries(tiling, monkeypatch):
    """With `QUANTIZE_CHUNK` small the quantizer converts a few rows of tiles at a time (several chunks,
    the last one short): the same codes and scales as the reference, and its largest temporary
    allocation is one chunk's fp32 copy, not the whole tensor's. A grouped [G, rows, cols] weight is
    chunked along its rows too."""
    quantize, block_rows, transposed = TILINGS[tiling]
    gen = generator(110 + list(TILINGS).index(tiling))
    x = tiled_randn((300, 200), gen, spread=10)
    monkeypatch.setattr(fp8, "QUANTIZE_CHUNK", 2 * TILE * TILE)
    rows, cols = (x.t() if transposed else x).shape
    chunk_rows = fp8.quantize_chunk_rows((rows, cols), block_rows)
    assert chunk_rows < rows, "several chunks"
    with LiveStorage() as memory:
        q = quantize(x)
        largest = memory.peak
    assert_matches_reference(q, Reference(x.t() if transposed else x, block_rows))
    result = q.data.numel() + 4 * q.scale.numel()
    padded_rows, padded_cols = -(-rows // block_rows) * block_rows, -(-cols // TILE) * TILE
    whole, chunk = 8 * padded_rows * padded_cols, 8 * chunk_rows * padded_cols  # fp32 padded and scaled values
    print(f"peak {largest} bytes: the result {result} and the temporaries of one chunk ({chunk}) where the whole "
          f"tensor's would be {whole}")
    assert largest == result + chunk + 4 * (chunk_rows // block_rows) * (padded_cols // TILE)  # + its scales
    grouped = torch.stack([tiled_randn((300, 200), gen) for _ in range(3)])
    q_grouped = fp8.quantize_128x128(grouped)
    for group in range(3):
        assert_matches_reference(Fp8Tensor(q_grouped.data[group], q_grouped.scale[group], TILE),
                                 Reference(grouped[group], TILE))


def special_rows() -> torch.Tensor:
    """One 1x128 tile per row, each an edge case (the rest of each row is drawn at random)."""
    gen = generator(7)
    x = torch.randn(7, TILE, generator=gen)
    x[0] = 0                                     # all zero: scale 1, zero codes
    x[1] *= 100 / x[1].abs().max()               # amax exactly 448 below, with exact ties
    x[1, :6] = torch.tensor([448.0, -448.0, 1.0625, 17.0, -3 * 2.0 ** -10, 2.0 ** -10])
    x[2] *= 1000 / x[2].abs().max()              # amax above 448
    x[3] *= 448 * 2.0 ** -10 / x[3].abs().max()  # amax 448 2^k: the power-of-two scale is 2^k exactly
    x[4, 1:] *= 2.0 ** -8                        # most values in E4M3's subnormals
    x[4, 0] = 50.0
    x[5] *= 1e-40 / x[5].abs().max()             # fp32-subnormal amax: the scale stops at 2^-126
    x[6] *= 3e35                                 # near the top of fp32
    return x


@pytest.mark.parametrize("power_of_two", [False, True], ids=["amax-scale", "pow2-scale"])
def test_quantizer_edge_tiles_are_bit_exact(power_of_two):
    x = special_rows()
    q = quantize_1x128(x, power_of_two)
    assert_matches_reference(q, Reference(x, 1, power_of_two))
    scale = q.scale[:, 0]
    assert scale[0] == 1 and not codes(q)[0].any()
    assert scale[1] == 1 and codes(q)[1, :4].tolist() == [0x7E, 0xFE, 0x38, 0x58]  # ties to even: 1.0, 16.0
    assert codes(q)[1, 4:6].tolist() == [0x82, 0x00]  # -1.5 and 0.5 subnormal steps: ties to even
    assert scale[2] == (4 if power_of_two else to_fp32(1000 / 448))
    assert scale[3] == 2.0 ** -10
    assert scale[5] == 2.0 ** -126
    subnormal_codes = (codes(q)[4] & 0x78 == 0) & (codes(q)[4] & 0x07 != 0)
    assert subnormal_codes.sum() > 10


@pytest.mark.parametrize("power_of_two", [False, True], ids=["amax-scale", "pow2-scale"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_non_finite_tile_stays_non_finite(bad, power_of_two):
    """A tile holding inf or NaN dequantizes to NaN (its scale is inf or NaN), never to clamped finite
    values; the other tiles are untouched. Through a GEMM the row comes out NaN."""
    gen = generator(11)
    x = torch.randn(4, 2 * TILE, generator=gen)
    x[2, 130] = bad
    q = quantize_1x128(x, power_of_two)
    assert not q.scale[2, 1].isfinite()
    dequantized = q.data[2, TILE:].float() * q.scale[2, 1]
    assert bool(dequantized.isnan().all())
    clean = Reference(x[[0, 1, 3]], 1, power_of_two)
    assert_matches_reference(Fp8Tensor(q.data[[0, 1, 3]], q.scale[[0, 1, 3]], 1), clean)
    y = emulated_fp8_mm(q, quantize_128x128(torch.randn(8, 2 * TILE, generator=gen)), torch.float32)
    assert bool(y[2].isnan().all()) and bool(y[[0, 1, 3]].isfinite().all())


def test_padding_is_zero_padding():
    """Dimensions not a multiple of 128 are padded with zeros: the result equals quantizing the
    zero-padded tensor, cut back to the input's shape."""
    x = tiled_randn((150, 300), generator(12))
    padded = torch.zeros(256, 384)
    padded[:150, :300] = x
    for block_rows in (1, TILE):
        q, q_padded = quantize_tiles(x, block_rows), quantize_tiles(padded, block_rows)
        assert q.shape == x.shape
        assert torch.equal(codes(q), codes(q_padded)[:150, :300])
        assert torch.equal(q.scale, q_padded.scale[:q.scale.shape[0]])


GROUP_SIZES = [9, 0, 160, 71]


def group_offsets(sizes: list[int]) -> torch.Tensor:
    return torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)


def group_ends(sizes: list[int]) -> GroupEnds:
    return GroupEnds(group_offsets(sizes))


def group_rows(sizes: list[int]) -> list[slice]:
    ends = torch.cumsum(torch.tensor(sizes), 0).tolist()
    return [slice(end - size, end) for size, end in zip(sizes, ends)]


def test_grouped_128x1_tiles_restart_at_each_group():
    """Each group's rows are tiled 128 at a time from the group's first row; the tiles of a group are
    consecutive, zero-padded, and the spare tiles at the end are zeros with scale 1."""
    x = tiled_randn((sum(GROUP_SIZES), 200), generator(13))
    q, tile_groups = quantize_128x1_grouped(x, group_offsets(GROUP_SIZES))
    tile = 0
    for group, rows in enumerate(group_rows(GROUP_SIZES)):
        tiles = -(-(rows.stop - rows.start) // TILE)
        assert tile_groups[tile:tile + tiles].tolist() == [group] * tiles
        columns = slice(tile * TILE, (tile + tiles) * TILE)
        ref = Reference(x[rows].t(), 1)
        group_q = Fp8Tensor(q.data[:, columns][:, :rows.stop - rows.start], q.scale[:, tile:tile + tiles], 1)
        assert_matches_reference(group_q, ref)
        assert not codes(q)[:, columns][:, rows.stop - rows.start:].any()
        tile += tiles
    assert tile_groups[tile:].tolist() == [len(GROUP_SIZES) - 1] * (len(tile_groups) - tile)
    assert not codes(q)[:, tile * TILE:].any() and bool((q.scale[:, tile:] == 1).all())


# ---- the GEMMs ----

def gemm_bound(a: torch.Tensor, b: torch.Tensor, ref_a: Reference, ref_b: Reference) -> torch.Tensor:
    """The module docstring's bound on |fp8(A) fp8(B)^T - A B^T| per output (A [M, K], B [N, K])."""
    a, b = a.double(), b.double()
    u_a, u_b = ref_a.error_bound(a), ref_b.error_bound(b)
    accumulation = (a.shape[1] + 2) * 2.0 ** -24 * ((a.abs() + u_a) @ (b.abs() + u_b).t())
    return u_a @ b.abs().t() + a.abs() @ u_b.t() + u_a @ u_b.t() + accumulation


def assert_gemm(name: str, got: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                ref_a: Reference, ref_b: Reference) -> None:
    """got = fp8 A @ fp8 B^T: within the bound of float64 A @ B^T, and within fp32 accumulation of the
    float64 product of the reference-quantized operands."""
    exact = a.double() @ b.double().t()
    error = (got.double() - exact).abs()
    bound = gemm_bound(a, b, ref_a, ref_b)
    scale = 2.0 ** -4 * (a.double().abs() @ b.double().abs().t())
    print(f"{name}: worst |error| = {(error / scale).max().item():.3g} x 2^-4 sum|a||b|, "
          f"{(error / bound).max().item():.3g} x the bound")
    assert bool((error <= bound).all()), f"{name}: {int((error > bound).sum())} outputs beyond the bound"
    quantized_product = ref_a.values @ ref_b.values.t()
    accumulation = (a.shape[1] + 4) * 2.0 ** -24 * (ref_a.values.abs() @ ref_b.values.abs().t())
    beyond = (got.double() - quantized_product).abs() > accumulation
    assert not beyond.any(), f"{name}: {int(beyond.sum())} outputs differ from the quantized operands' product"


@pytest.mark.parametrize("power_of_two", [False, True], ids=["amax-scale", "pow2-scale"])
@pytest.mark.parametrize("in_features", [256, 200])
def test_fp8_linear_forward_and_gradients_within_bound(in_features, power_of_two):
    """Linear(K, 160) on [3, 100, K] (300 rows: two whole 128-row Wgrad tiles and a partial one),
    K a multiple of 128 or padded: y, grad_x and grad_w through `Fp8GemmOps`."""
    gen = generator(20 + in_features + power_of_two)
    layer = Linear(in_features, 160)
    layer.gemms = Fp8GemmOps(power_of_two_scales=power_of_two)
    weight = tiled_randn((160, in_features), gen)
    layer.weight.data = weight.clone()
    x_rows = tiled_randn((300, in_features), gen)
    x = x_rows.reshape(3, 100, in_features).requires_grad_()
    grad_rows = tiled_randn((300, 160), gen)
    y = layer(x)
    y.backward(grad_rows.reshape(3, 100, 160))
    assert y.shape == (3, 100, 160) and y.dtype == x.grad.dtype == layer.weight.grad.dtype == torch.float32

    ref_x, ref_w = Reference(x_rows, 1, power_of_two), Reference(weight, TILE, power_of_two)
    assert_gemm("Fprop", y.detach().reshape(300, 160), x_rows, weight, ref_x, ref_w)
    ref_grad = Reference(grad_rows, 1, power_of_two)
    ref_w_t = Reference(weight.t(), TILE, power_of_two)
    assert_gemm("Dgrad", x.grad.reshape(300, in_features), grad_rows, weight.t(), ref_grad, ref_w_t)
    ref_grad_columns = Reference(grad_rows.t(), 1, power_of_two)
    ref_x_columns = Reference(x_rows.t(), 1, power_of_two)
    assert_gemm("Wgrad", layer.weight.grad, grad_rows.t(), x_rows.t(), ref_grad_columns, ref_x_columns)


@pytest.mark.parametrize("in_features", [256, 200])
def test_fp8_grouped_linear_forward_and_gradients_within_bound(in_features):
    """GroupedLinear(4 groups, K, 144), groups of 9, 0, 160 and 71 rows: every group against its own
    float64 GEMMs (its Wgrad tiled 128 rows at a time from its first row); the empty group's
    weight gradient is zero."""
    gen = generator(30 + in_features)
    layer = GroupedLinear(len(GROUP_SIZES), in_features, 144)
    layer.gemms = Fp8GemmOps()
    weight = torch.stack([tiled_randn((144, in_features), gen) for _ in GROUP_SIZES])
    layer.weight.data = weight.clone()
    x = tiled_randn((sum(GROUP_SIZES), in_features), gen).requires_grad_()
    grad_y = tiled_randn((sum(GROUP_SIZES), 144), gen)
    y = layer(x, group_ends(GROUP_SIZES))
    y.backward(grad_y)
    assert not layer.weight.grad[1].any()
    for group, rows in enumerate(group_rows(GROUP_SIZES)):
        if rows.start == rows.stop:
            continue
        x_g, w_g, grad_g = x.detach()[rows], weight[group], grad_y[rows]
        assert_gemm(f"Fprop group {group}", y.detach()[rows], x_g, w_g, Reference(x_g, 1), Reference(w_g, TILE))
        assert_gemm(f"Dgrad group {group}", x.grad[rows], grad_g, w_g.t(), Reference(grad_g, 1),
                    Reference(w_g.t(), TILE))
        assert_gemm(f"Wgrad group {group}", layer.weight.grad[group], grad_g.t(), x_g.t(),
                    Reference(grad_g.t(), 1), Reference(x_g.t(), 1))


def simple_dequantize(q: Fp8Tensor) -> torch.Tensor:
    """Every element at once, from the hand-decoded table: E4M3 value (exact in fp32) x its fp32 scale."""
    scales = q.scale.repeat_interleave(q.block_rows, -2)[..., :q.shape[-2], :]
    scales = scales.repeat_interleave(TILE, -1)[..., :q.shape[-1]]
    return E4M3[codes(q).long()].float() * scales


def simple_chunked_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 a @ b^T as one fp32 matmul per 128 columns of K, summed in order."""
    return sum(a[:, k:k + TILE] @ b[:, k:k + TILE].t() for k in range(0, a.shape[1], TILE))


def test_emulation_equals_a_simpler_emulation_bit_for_bit():
    """The GEMMs dequantize chunk by chunk (and group by group through `grouped_mm`); dequantizing
    everything first, then one fp32 matmul per 128 columns of K, gives the same bits."""
    gen = generator(40)
    sizes, offsets = GROUP_SIZES, group_offsets(GROUP_SIZES)
    a = quantize_1x128(tiled_randn((sum(sizes), 200), gen))
    weight = quantize_128x128(torch.stack([tiled_randn((144, 200), gen) for _ in sizes]))
    a_32, weight_32 = simple_dequantize(a), simple_dequantize(weight)

    assert torch.equal(fp8_mm(a, Fp8Tensor(weight.data[2], weight.scale[2], TILE), torch.float32),
                       simple_chunked_mm(a_32, weight_32[2]))
    grouped = fp8_grouped_mm(a, weight, GroupEnds(offsets), torch.float32)
    for group, rows in enumerate(group_rows(sizes)):
        assert torch.equal(grouped[rows], simple_chunked_mm(a_32[rows], weight_32[group]))

    grad_columns, tile_groups = quantize_128x1_grouped(tiled_randn((sum(sizes), 144), gen), offsets)
    x_columns, _ = quantize_128x1_grouped(tiled_randn((sum(sizes), 200), gen), offsets)
    weight_grad = fp8_grouped_weight_grad(grad_columns, x_columns, GroupEnds(offsets), tile_groups)
    grad_32, x_32 = simple_dequantize(grad_columns), simple_dequantize(x_columns)
    for group in range(len(sizes)):
        tiles = (tile_groups == group).nonzero().flatten().tolist()
        expected = torch.zeros(144, 200)
        for tile in tiles:
            rows = slice(tile * TILE, (tile + 1) * TILE)
            expected += simple_chunked_mm(grad_32[:, rows], x_32[:, rows])
        assert torch.equal(weight_grad[group], expected)


def test_fp8_gemm_output_dtype():
    """bf16 by default: the fp32 accumulation rounded once."""
    gen = generator(41)
    a, b = quantize_1x128(torch.randn(16, 256, generator=gen)), quantize_128x128(torch.randn(32, 256, generator=gen))
    out = fp8_mm(a, b)
    assert out.dtype == torch.bfloat16 and torch.equal(out, fp8_mm(a, b, torch.float32).bfloat16())


def test_linear_saves_fp8_tensors_only():
    """FP8 activation caching: the backward's inputs are the 128x1-tiled input and the 128x128-block
    weight in E4M3 with their fp32 scales; no high-precision copy of x or W is kept."""
    gen = generator(42)
    layer, grouped = Linear(200, 160), GroupedLinear(len(GROUP_SIZES), 200, 144)
    layer.gemms = grouped.gemms = Fp8GemmOps()
    x = torch.randn(2, 150, 200, generator=gen, requires_grad=True)
    x_grouped = torch.randn(sum(GROUP_SIZES), 200, generator=gen, requires_grad=True)
    saved = []

    def record(tensor: torch.Tensor) -> torch.Tensor:
        saved.append((tensor.dtype, tuple(tensor.shape)))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor):
        layer(x)
    assert saved == [(FP8_DTYPE, (160, 200)), (torch.float32, (2, 2)),
                     (FP8_DTYPE, (200, 300)), (torch.float32, (200, 3))]
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor):
        grouped(x_grouped, group_ends(GROUP_SIZES))
    tiles = (sum(GROUP_SIZES) + 127 * len(GROUP_SIZES)) // TILE
    assert saved == [(FP8_DTYPE, (4, 144, 200)), (torch.float32, (4, 2, 2)), (torch.int64, (tiles,)), (FP8_DTYPE, (200, tiles * TILE)), (torch.float32, (200, tiles))]


def test_autocast_does_not_reach_the_emulation():
    """Under bf16 autocast the output is bf16 (the GEMM dtype) but the chunks still multiply in fp32:
    the output is the fp32 result rounded once."""
    gen = generator(43)
    layer = Linear(256, 128)
    layer.gemms = Fp8GemmOps()
    x = torch.randn(64, 256, generator=gen)
    expected = layer(x).detach().bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, expected)


def test_bf16_parameters_give_bf16_outputs_and_gradients():
    gen = generator(44)
    layer = Linear(256, 128)
    layer.gemms = Fp8GemmOps()
    layer.to(torch.bfloat16)
    x = torch.randn(64, 256, generator=gen).bfloat16().requires_grad_()
    y = layer(x)
    y.backward(torch.randn(64, 128, generator=gen).bfloat16())
    assert y.dtype == x.grad.dtype == layer.weight.grad.dtype == torch.bfloat16


def test_non_finite_gradient_reaches_both_gradients():
    """A NaN in grad_y leaves NaN in the input and the weight gradient, for the step guard to see."""
    gen = generator(45)
    layer = Linear(256, 128)
    layer.gemms = Fp8GemmOps()
    x = torch.randn(64, 256, generator=gen, requires_grad=True)
    grad_y = torch.randn(64, 128, generator=gen)
    grad_y[5, 7] = math.nan
    layer(x).backward(grad_y)
    assert bool(x.grad[5].isnan().all()) and bool(layer.weight.grad[7].isnan().all())


def test_blockwise_kernel_is_not_used_on_cpu():
    """The CPU build has `scaled_mm` but refuses blockwise scales at run time: the emulation runs."""
    assert blockwise_scaled_mm_supported("cpu") is False
    assert blockwise_scaled_mm_supported(torch.device("cpu")) is False


# ---- the routed experts' SwiGLU: input cached in FP8, output recomputed (§3.3.3) ----

def swiglu(gate_up: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up * row_weights


def activated_case(seed: int, width: int = 96) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate|up rows [M, 2 width] (2 x 96 = 192 channels: a 1x128 tile straddles gate and up), router
    weights [M, 1], grouped down-projection weights [G, 144, width] and an output gradient."""
    gen = generator(seed)
    rows = sum(GROUP_SIZES)
    return (tiled_randn((rows, 2 * width), gen, spread=3), torch.rand(rows, 1, generator=gen) + 0.5,
            torch.stack([tiled_randn((144, width), gen) for _ in GROUP_SIZES]), tiled_randn((rows, 144), gen))


def run_activated(layer: GroupedLinear, x: torch.Tensor, row_weights: torch.Tensor,
                  grad_y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x, row_weights = x.clone().requires_grad_(), row_weights.clone().requires_grad_()
    y = layer.forward_activated(swiglu, x, row_weights, group_ends(GROUP_SIZES), Recompute(()))
    y.backward(grad_y)
    return y.detach(), x.grad, row_weights.grad, layer.weight.grad


@pytest.mark.parametrize("power_of_two", [False, True], ids=["amax-scale", "pow2-scale"])
def test_activated_grouped_gemm_recomputes_the_swiglu_from_its_fp8_cache(power_of_two):
    """The forward is the FP8 grouped GEMM of the SwiGLU of x itself; the backward's gradients are
    those of the SwiGLU of x's 1x128 FP8 quantization (the cache) followed by that GEMM, bit for bit:
    the reference runs the (separately checked) quantizer, dequantizes, and backpropagates through
    the SwiGLU and `Fp8GroupedLinearFunction` in plain autograd."""
    x, row_weights, weight, grad_y = activated_case(50 + power_of_two)
    layer = GroupedLinear(len(GROUP_SIZES), 96, 144)
    layer.gemms = Fp8GemmOps(power_of_two_scales=power_of_two)
    layer.weight.data = weight.clone()
    y, grad_x, grad_row_weights, grad_weight = run_activated(layer, x, row_weights, grad_y)

    reference = GroupedLinear(len(GROUP_SIZES), 96, 144)
    reference.gemms = Fp8GemmOps(power_of_two_scales=power_of_two)
    reference.weight.data = weight.clone()
    groups = group_ends(GROUP_SIZES)
    assert torch.equal(y, reference(swiglu(x, row_weights), groups).detach())
    cache = Reference(x, 1, power_of_two)
    x_cached = cache.values.float().requires_grad_()
    w_ref = row_weights.clone().requires_grad_()
    reference(swiglu(x_cached, w_ref), groups).backward(grad_y)
    assert torch.equal(grad_x, x_cached.grad) and torch.equal(grad_row_weights, w_ref.grad)
    assert torch.equal(grad_weight, reference.weight.grad)
    # the cache's rounding reaches the gradients: recomputing from x itself gives others
    x_itself = x.clone().requires_grad_()
    reference(swiglu(x_itself, row_weights), groups).backward(grad_y)
    assert not torch.equal(grad_x, x_itself.grad)


def test_activated_grouped_gemm_keeps_the_fp8_cache_not_the_activation():
    """What the backward keeps: the E4M3 gate|up rows in 1x128 tiles with their scales, the router
    weights and the FP8 weight (the group ends ride with the GroupEnds the GEMMs share); neither x nor the
    activation's output in high precision."""
    x, row_weights, weight, _ = activated_case(52)
    layer = GroupedLinear(len(GROUP_SIZES), 96, 144)
    layer.gemms = Fp8GemmOps()
    saved = []

    def record(tensor: torch.Tensor) -> torch.Tensor:
        saved.append((tensor.dtype, tuple(tensor.shape)))
        return tensor

    rows = sum(GROUP_SIZES)
    with torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor):
        layer.forward_activated(swiglu, x.requires_grad_(), row_weights.requires_grad_(), group_ends(GROUP_SIZES),
                                Recompute(("moe_act",)))
    assert saved == [(FP8_DTYPE, (rows, 192)), (torch.float32, (rows, 2)), (torch.float32, (rows, 1)),
                     (FP8_DTYPE, (4, 144, 96)), (torch.float32, (4, 2, 1))]


@pytest.mark.parametrize("power_of_two", [False, True], ids=["amax-scale", "pow2-scale"])
def test_activated_linear_recomputes_the_swiglu_from_its_fp8_cache(power_of_two):
    """The shared expert's down projection (one weight, no router weights) as the routed experts': the
    forward is the FP8 GEMM of the SwiGLU of x itself; the backward's gradients are those of the SwiGLU
    of x's 1x128 FP8 quantization followed by `Fp8LinearFunction`, bit for bit; and it keeps only the
    E4M3 cache with its scales and the FP8 weight. The rows come as [2, M / 2, 192], as a Linear's input may."""
    x, _, weights, grad_y = activated_case(54 + power_of_two)
    x, grad_y = x.view(2, -1, x.shape[-1]), grad_y.view(2, -1, grad_y.shape[-1])

    def layer() -> Linear:
        linear = Linear(96, 144)
        linear.gemms = Fp8GemmOps(power_of_two_scales=power_of_two)
        linear.weight.data = weights[0].clone()
        return linear

    activated, reference = layer(), layer()
    x_itself = x.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, tuple(t.shape))) or t,
                                                  lambda t: t):
        y = activated.forward_activated(packed_swiglu, x_itself)
    rows = x.shape[0] * x.shape[1]
    assert saved == [(FP8_DTYPE, (rows, 192)), (torch.float32, (rows, 2)), (FP8_DTYPE, (144, 96)),
                     (torch.float32, (2, 1))]
    y.backward(grad_y)
    assert torch.equal(y.detach(), reference(packed_swiglu(x)).detach())
    x_cached = Reference(x.reshape(rows, -1), 1, power_of_two).values.float().view(x.shape).requires_grad_()
    reference(packed_swiglu(x_cached)).backward(grad_y)
    assert torch.equal(x_itself.grad, x_cached.grad) and torch.equal(activated.weight.grad, reference.weight.grad)
    x_plain = x.clone().requires_grad_()  # the cache's rounding reaches the gradients
    layer()(packed_swiglu(x_plain)).backward(grad_y)
    assert not torch.equal(x_itself.grad, x_plain.grad)


def test_the_swiglu_input_ablation_keeps_the_activation_and_the_fp8_gemm():
    """benchmarks/fp8_loss_curves --bf16-swiglu-input on the shared expert's down projection: the SwiGLU's
    input kept in high precision (no FP8 cache) and its output saved as bf16 training does, the GEMM still
    FP8 (an FP8 weight and the 128x1 copy of its input saved)."""
    from benchmarks.fp8_loss_curves import Bf16SwigluInput

    x, _, weights, _ = activated_case(56)
    linear = Linear(96, 144)
    linear.gemms = Bf16SwigluInput(Fp8GemmOps())
    linear.weight.data = weights[0].clone()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, tuple(t.shape))) or t,
                                                  lambda t: t):
        linear.forward_activated(packed_swiglu, x.requires_grad_())
    rows = x.shape[0]
    assert saved.count((torch.float32, (rows, 96))) == 3  # the SiLU's input, its output and up (views of x)
    assert (FP8_DTYPE, (144, 96)) in saved and (FP8_DTYPE, (96, rows)) in saved  # FP8 weight, 128x1 input
    assert (FP8_DTYPE, tuple(x.shape)) not in saved  # no FP8 cache of the SwiGLU's input


# ---- the FP8 dispatch's rows as the gate/up GEMM's quantized input ----

def dispatched_case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Fp8Tensor]:
    """bf16 rows [240, 256] as the FP8 dispatch's receiver has them (E4M3 with power-of-two scales, from
    parallel.dispatch.fp8, dequantized), grouped weights [4, 144, 256] and an output gradient. Some tiles
    are under the dispatch's amax floor (1e-4): one all zero, one tiny, one whose received amax is between
    448 x 2^-23 and 1e-4; the rows' `Fp8Tensor` is returned as the dispatch moved it."""
    from parallel.dispatch.fp8 import dequantize_e4m3, quantize_e4m3

    gen = generator(seed)
    x = tiled_randn((sum(GROUP_SIZES), 256), gen).bfloat16()
    x[3, :128] = 0
    x[10, 128:] *= 1e-7 / x[10, 128:].abs().max()
    x[20, :128] *= 8e-5 / x[20, :128].abs().max()
    data, scale = quantize_e4m3(x, round_scale=True)
    weight = torch.stack([tiled_randn((144, 256), gen) for _ in GROUP_SIZES]).bfloat16()
    grad_y = tiled_randn((sum(GROUP_SIZES), 144), gen).bfloat16()
    return dequantize_e4m3(data, scale, torch.bfloat16), weight, grad_y, Fp8Tensor(data, scale, 1)


def run_gate_up(x: torch.Tensor, weight: torch.Tensor, grad_y: torch.Tensor, x_fp8: Fp8Tensor | None,
                monkeypatch: pytest.MonkeyPatch) -> tuple[tuple[torch.Tensor, ...], int]:
    """The routed experts' gate/up GEMM (power-of-two input scales at the dispatch boundary) forward and
    backward; also how often `quantize_1x128` quantized its input x itself."""
    layer = GroupedLinear(len(GROUP_SIZES), 256, 144).bfloat16()
    layer.gemms = Fp8GemmOps().at_dispatch_boundary(inputs=True)
    layer.weight.data = weight.clone()
    x = x.clone().requires_grad_()
    calls = []
    quantize = model.fp8.quantize_1x128
    monkeypatch.setattr(model.fp8, "quantize_1x128", lambda t, *a: calls.append(t.data_ptr() == x.data_ptr()
                                                                                  and t.shape == x.shape)
                        or quantize(t, *a))
    y = layer(x, group_ends(GROUP_SIZES), x_fp8)
    y.backward(grad_y)
    monkeypatch.setattr(model.fp8, "quantize_1x128", quantize)
    return (y.detach(), x.grad, layer.weight.grad), sum(calls)


@pytest.mark.parametrize("rows", ["quantize_1x128", "dispatch"])
def test_gate_up_gemm_takes_the_dispatched_fp8_rows_without_quantizing_its_input(rows, monkeypatch):
    """Given x's 1x128 FP8 rows, the grouped GEMM's Fprop uses them and never quantizes x; output, input
    and weight gradients are those of quantizing x, bit for bit: for rows equal to quantize_1x128(x,
    power of two), and for the dispatch's own rows, whose codes and scales differ from those in some
    tiles (amax under the dispatch's 1e-4 floor, or rounded down to 224) but not their values."""
    seed = random.SystemRandom().randrange(2 ** 32)
    x, weight, grad_y, dispatched = dispatched_case(seed)
    given = quantize_1x128(x, power_of_two_scale=True) if rows == "quantize_1x128" else dispatched
    if rows == "dispatch":
        differs = (given.scale != quantize_1x128(x, power_of_two_scale=True).scale).any(1)
        assert differs[[3, 10]].all(), "the floor's tiles travel with their own scale"
    want, quantized = run_gate_up(x, weight, grad_y, None, monkeypatch)
    got, quantized_given = run_gate_up(x, weight, grad_y, given, monkeypatch)
    assert (quantized, quantized_given) == (1, 0)
    for name, a, b in zip(("output", "grad x", "grad weight"), got, want):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="powers of two"):  # amax scales would quantize x to other values
        Fp8GemmOps().grouped(x, weight, group_ends(GROUP_SIZES), given)
