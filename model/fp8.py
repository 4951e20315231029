"""FP8 (E4M3) GEMMs as DeepSeek-V3 trains them (§3.3): fine-grained quantization, the blockwise GEMM
and the autograd Functions of the FP8 Linear and grouped expert Linear (`Fp8GemmOps`).

What this module owns:

- **Quantization.** A tile of 128 consecutive elements along the last dimension of one row (1x128,
  activations and gradients) or of 128 rows (128x128, weights) shares one fp32 scale:
  scale = amax / 448, so the tile's largest magnitude maps to E4M3's largest finite value. The
  quantized value is x / scale clamped to +-448, then cast (round to nearest even); the clamp is
  explicit, the cast's overflow behaviour is never relied on. With `power_of_two_scale` the scale
  is rounded up to a power of two (nothing can overflow, and dequantization is exact).
  Rules for the edge cases:
  - an all-zero tile gets scale 1 and zero values (no division by zero);
  - an amax so small that amax / 448 is below fp32's smallest normal (2^-126) gets scale 2^-126,
    so the scale never underflows to zero or loses precision;
  - a tile holding inf or NaN gets a non-finite scale (inf or NaN), so every value it dequantizes to
    is NaN: the GEMM's output is non-finite and the trainer's non-finite step guard skips the step.
  - dimensions that are not a multiple of 128 are padded with zeros internally, as the paper's
    kernels pad K: the last tile along a dimension is shorter, with the scale its zero-padded tile
    would have. The quantized tensor keeps the input's shape.
- **The 128x1 tiling** that the weight-gradient GEMM needs (128 rows x 1 column) is the 1x128 tiling
  of the transposed tensor: `quantize_128x1(x)` returns it transposed, [K, M], so that every GEMM
  here contracts along the last dimension of both operands. For the grouped GEMM the tiles restart
  at each group: every group's rows are padded to a whole number of 128-row tiles.
- **The blockwise GEMM**, a @ b^T with both operands tiled along the contraction dimension: torch's
  blockwise `scaled_mm` on a device that runs it (`blockwise_scaled_mm_supported`), otherwise an
  exact emulation: dequantize per tile, one FP32 GEMM per 128-wide chunk of K, partial sums
  accumulated in FP32 (the paper promotes to FP32 every 128 elements of K). torch has no blockwise
  grouped kernel: on a device that runs the dense one, the grouped GEMMs run it once per group.
- **FP8 activation caching.** The Functions save the FP8 tensors the backward consumes (the input
  in the 128x1 tiling, the weight in 128x128 blocks), never a high-precision copy of the input. The
  MoE's down projections (the routed experts' and the shared expert's) cache their SwiGLU's input
  (1x128 tiles) and recompute the SwiGLU in backward (§3.3.3): `Fp8ActivatedFunction`.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model.layers import GemmOps, GroupEnds, gemm_dtype, grouped_mm
from model.recompute import Recompute

E4M3_MAX = 448.0
TILE = 128
QUANTIZE_CHUNK = 1 << 24
"""Padded input elements the quantizer converts at once. Its fp32 temporaries (the padded copy and the
scaled values, 8 bytes per element) are then bounded by this, not by the tensor (a fused kernel
would have none)."""
MIN_SCALE = 2.0 ** -126  # fp32's smallest normal
KERNEL_ROWS = 16
"""torch's blockwise kernel takes rows (and a 1x128-tiled second operand's rows) in multiples of this."""
FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class Fp8Tensor:
    """E4M3 values [..., rows, cols] and the fp32 scales of their tiles [..., ceil(rows / block_rows),
    ceil(cols / 128)]: an element is data * its tile's scale. Tiles run along the last dimension,
    128 wide; `block_rows` consecutive rows (1 or 128) share a scale."""

    data: torch.Tensor
    scale: torch.Tensor
    block_rows: int

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def t(self) -> Fp8Tensor:
        """The transpose of a 128x128-block tensor, which is the 128x128 quantization of the transpose."""
        if self.block_rows != TILE:
            raise ValueError("only 128x128 blocks transpose into a tiling along the other dimension")
        return Fp8Tensor(self.data.transpose(-2, -1), self.scale.transpose(-2, -1), TILE)

    def index_rows(self, index: torch.Tensor) -> Fp8Tensor:
        """Rows `index` of a 1x128-tiled matrix [rows, cols], each with its own scales."""
        if self.block_rows != 1 or self.data.dim() != 2:
            raise ValueError("rows are selected from a 1x128-tiled matrix [rows, cols]")
        return Fp8Tensor(self.data.index_select(0, index), self.scale.index_select(0, index), 1)


def _ceil_div(a: int | torch.Tensor, b: int) -> int | torch.Tensor:
    return -(-a // b)


def power_of_two_ceil(values: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(v)) of positive normal floats, exactly (from frexp, since a float log2 rounds
    2^k (1 + 2^-23) down to k)."""
    mantissa, exponent = torch.frexp(values)  # values = mantissa * 2^exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(values), torch.where(mantissa == 0.5, exponent - 1, exponent))


def tile_scales(amax: torch.Tensor, power_of_two_scale: bool = False) -> torch.Tensor:
    """fp32 scales from tile amaxes, with the module docstring's rules for zero, tiny and non-finite
    amaxes (clamp and where propagate NaN and inf; frexp of them would not, hence the isfinite)."""
    scale = torch.where(amax == 0, 1.0, (amax.float() / E4M3_MAX).clamp(min=MIN_SCALE))
    if power_of_two_scale:
        scale = torch.where(scale.isfinite(), power_of_two_ceil(scale), scale)
    return scale


def _pad_to_tiles(x: torch.Tensor, block_rows: int) -> torch.Tensor:
    """Zeros appended to the last dimension (and the rows, for 128-row blocks) up to whole tiles."""
    rows, cols = x.shape[-2:]
    return F.pad(x, (0, _ceil_div(cols, TILE) * TILE - cols, 0, _ceil_div(rows, block_rows) * block_rows - rows))


def quantize_tiles(x: torch.Tensor, block_rows: int, power_of_two_scale: bool = False) -> Fp8Tensor:
    """x [..., rows, cols] -> E4M3 with one scale per `block_rows` x 128 tile along the last dimension,
    converted `quantize_chunk_rows` rows at a time (`QUANTIZE_CHUNK`)."""
    if block_rows not in (1, TILE):
        raise ValueError(f"tiles have 1 or {TILE} rows, got {block_rows}")
    if x.dim() < 2:
        raise ValueError(f"quantization tiles a matrix [..., rows, cols], got shape {tuple(x.shape)}")
    rows, cols = x.shape[-2:]
    data = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(*x.shape[:-2], _ceil_div(rows, block_rows), _ceil_div(cols, TILE), device=x.device)
    step = quantize_chunk_rows(x.shape, block_rows)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        _quantize_into(x[..., start:stop, :], data[..., start:stop, :],
                       scale[..., start // block_rows:_ceil_div(stop, block_rows), :], block_rows, power_of_two_scale)
    return Fp8Tensor(data, scale, block_rows)


def quantize_chunk_rows(shape: torch.Size | tuple[int, ...], block_rows: int) -> int:
    """Rows of a [..., rows, cols] input the quantizer converts at once: whole tiles, at most
    `QUANTIZE_CHUNK` padded elements (at least one row of tiles)."""
    per_row = math.prod(shape[:-2]) * _ceil_div(shape[-1], TILE) * TILE
    return block_rows * max(1, QUANTIZE_CHUNK // (per_row * block_rows))


def _quantize_into(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, block_rows: int,
                   power_of_two_scale: bool) -> None:
    """Quantize x [..., rows, cols] (whole tiles of rows, but the last) into `data` and `scale`."""
    rows, cols = x.shape[-2:]
    padded = _pad_to_tiles(x.detach().float(), block_rows)
    tiles = padded.unflatten(-1, (-1, TILE)).unflatten(-3, (-1, block_rows))  # [..., Rb, block_rows, Cb, 128]
    scale.copy_(tile_scales(tiles.abs().amax(dim=(-3, -1)), power_of_two_scale))
    scaled = (tiles / scale.unsqueeze(-1).unsqueeze(-3)).clamp_(-E4M3_MAX, E4M3_MAX)
    data.copy_(scaled.flatten(-2).flatten(-3, -2)[..., :rows, :cols])  # the cast to E4M3 in the copy


def quantize_1x128(x: torch.Tensor, power_of_two_scale: bool = False) -> Fp8Tensor:
    """Activations and gradients: one scale per row per 128 channels of the last dimension (K)."""
    return quantize_tiles(x, 1, power_of_two_scale)


def quantize_128x128(weight: torch.Tensor, power_of_two_scale: bool = False) -> Fp8Tensor:
    """Weights [..., out, in]: one scale per 128x128 block (per group for a grouped weight [G, out, in])."""
    return quantize_tiles(weight, TILE, power_of_two_scale)


def quantize_128x1(x: torch.Tensor, power_of_two_scale: bool = False) -> Fp8Tensor:
    """x [M, K] in tiles of 128 rows x 1 column, returned transposed ([K, M], 1x128 tiles along M):
    the operand layout of the weight-gradient GEMM, which contracts over M."""
    return quantize_1x128(x.t(), power_of_two_scale)


def group_tiles(offsets: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row goes when every group is padded to whole 128-row tiles, and the group of each tile.

    offsets: int32 cumulative group ends (the last one is `rows`). Returns the padded position of each
    row [rows] and the group of each tile [tiles]. The tile count is the static bound
    (rows + 127 G) // 128, so the group sizes are never read on the host; the tiles past the last
    group's are all zeros, assigned to the last group.
    """
    ends = offsets.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    tiles_per_group = _ceil_div(counts, TILE)
    tile_ends = torch.cumsum(tiles_per_group, 0)
    padded_starts = (tile_ends - tiles_per_group) * TILE
    row = torch.arange(rows, device=offsets.device)
    group = torch.searchsorted(ends, row, right=True)
    destination = row - (ends - counts)[group] + padded_starts[group]
    num_tiles = (rows + (TILE - 1) * len(ends)) // TILE
    tile = torch.arange(num_tiles, device=offsets.device)
    tile_groups = torch.searchsorted(tile_ends, tile, right=True).clamp(max=len(ends) - 1)
    return destination, tile_groups


def quantize_128x1_grouped(x: torch.Tensor, offsets: torch.Tensor,
                           power_of_two_scale: bool = False) -> tuple[Fp8Tensor, torch.Tensor]:
    """x [M, K], rows sorted by group -> (the 128x1 tiling of x with each group's rows padded with zero
    rows to whole tiles, transposed: [K, 128 * tiles]; the group of each tile [tiles]). A tile never
    holds rows of two groups, so each group's weight gradient is a sum over its own tiles."""
    destination, tile_groups = group_tiles(offsets, x.shape[0])
    padded = x.new_zeros(len(tile_groups) * TILE, x.shape[1]).index_copy(0, destination, x)
    return quantize_128x1(padded, power_of_two_scale), tile_groups


def _row_scales(q: Fp8Tensor) -> torch.Tensor:
    """The scales of every row [..., rows, ceil(cols / 128)] (a 128x128 block's repeated on its rows)."""
    return q.scale.repeat_interleave(q.block_rows, dim=-2)[..., :q.shape[-2], :]


def dequantize(q: Fp8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data * scale in fp32, element by element, then cast to `dtype`."""
    scales = _row_scales(q).repeat_interleave(TILE, dim=-1)[..., :q.shape[-1]]
    return (q.data.float() * scales).to(dtype)


def dequantized_chunks(q: Fp8Tensor) -> Iterator[torch.Tensor]:
    """The fp32 dequantized 128-wide chunks of the last dimension (the last one may be narrower)."""
    scales = _row_scales(q)
    for chunk in range(scales.shape[-1]):
        columns = slice(chunk * TILE, (chunk + 1) * TILE)
        yield q.data[..., columns].float() * scales[..., chunk:chunk + 1]


def _check_operands(a: Fp8Tensor, b: Fp8Tensor) -> None:
    if a.block_rows != 1:
        raise ValueError("the first operand of an FP8 GEMM is tiled 1x128 (activations, gradients)")
    if a.shape[-1] != b.shape[-1]:
        raise ValueError("FP8 GEMM operands contract along their last dimension: "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")


def emulated_fp8_mm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """a [M, K] @ b [N, K]^T: one FP32 GEMM per 128-wide chunk of K on the dequantized tiles, the
    partial sums accumulated in FP32, cast once to `out_dtype`."""
    _check_operands(a, b)
    out = torch.zeros(a.shape[0], b.shape[0], device=a.data.device)
    with torch.autocast(a.data.device.type, enabled=False):  # autocast would run the chunks in bf16
        for a_chunk, b_chunk in zip(dequantized_chunks(a), dequantized_chunks(b)):
            out += a_chunk @ b_chunk.t()
    return out.to(out_dtype)


def fp8_mm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """a [M, K] (1x128 tiles) @ b [N, K]^T (128x128 blocks, or 1x128 tiles for the weight gradient)
    -> [M, N] in `out_dtype`: torch's blockwise kernel where it runs these operands, else the emulation."""
    if _kernel_takes(a, b) and blockwise_scaled_mm_supported(a.data.device, out_dtype):
        return _torch_blockwise_mm(a, b, out_dtype)
    return emulated_fp8_mm(a, b, out_dtype)


def fp8_grouped_mm(a: Fp8Tensor, b: Fp8Tensor, groups: GroupEnds,
                   out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """a [M, K] (1x128 tiles, rows sorted by group) times b [G, N, K] (128x128 blocks per group):
    row r of group g is a_r @ b_g^T. Where the device runs torch's blockwise kernel, one kernel GEMM
    per non-empty group (the group ends read on the host, once for every GEMM sharing `groups`);
    else emulated: per 128-wide chunk of K one FP32 grouped GEMM, the partial sums accumulated in FP32."""
    _check_operands(a, b)
    if _grouped_kernel_takes(a, b) and blockwise_scaled_mm_supported(a.data.device, out_dtype):
        out = torch.zeros(a.shape[0], b.shape[-2], dtype=out_dtype, device=a.data.device)
        for group, rows in _group_slices(groups.host()):
            out[rows] = _torch_blockwise_mm(_kernel_rows(a, rows), _group(b, group), out_dtype)[:rows.stop - rows.start]
        return out
    out = torch.zeros(a.shape[0], b.shape[-2], device=a.data.device)
    with torch.autocast(a.data.device.type, enabled=False):
        for a_chunk, b_chunk in zip(dequantized_chunks(a), dequantized_chunks(b)):
            out += grouped_mm(a_chunk, b_chunk.transpose(1, 2), groups.offsets)
    return out.to(out_dtype)


def fp8_grouped_weight_grad(a: Fp8Tensor, b: Fp8Tensor, groups: GroupEnds, tile_groups: torch.Tensor,
                            out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per group g: a_g @ b_g^T -> [G, N, K], from a [N, R] (grad_y) and b [K, R] (x), both from
    `quantize_128x1_grouped` of rows ending at `groups`: tile t of 128 rows belongs to group
    tile_groups[t], a group's tiles consecutive. Where the device runs torch's blockwise kernel, one
    kernel GEMM per group over its tiles (from the group ends on the host; the last group's also covers
    the all-zero tiles past the groups, at most G - 1); else emulated: one FP32 GEMM per tile, added in
    FP32 into its group's gradient. A group with no rows gets zeros."""
    _check_operands(a, b)
    out = torch.zeros(len(groups), a.shape[0], b.shape[0], device=a.data.device)
    if _kernel_takes(a, b) and blockwise_scaled_mm_supported(a.data.device, out_dtype):
        for group, columns in _group_slices(_tile_column_ends(groups.host(), len(tile_groups))):
            out[group] = _torch_blockwise_mm(_tile_columns(a, columns), _tile_columns(b, columns), out_dtype)
        return out.to(out_dtype)
    with torch.autocast(a.data.device.type, enabled=False):
        for tile, (a_chunk, b_chunk) in enumerate(zip(dequantized_chunks(a), dequantized_chunks(b))):
            out.index_add_(0, tile_groups[tile:tile + 1], (a_chunk @ b_chunk.t()).unsqueeze(0))
    return out.to(out_dtype)


def _grouped_kernel_takes(a: Fp8Tensor, b: Fp8Tensor) -> bool:
    """The grouped GEMMs torch's blockwise kernel runs group by group (a group's rows are padded to the
    kernel's row multiple): whole 128-wide K tiles and whole 128-row weight blocks."""
    return a.data.dim() == 2 and b.data.dim() == 3 and a.shape[-1] % TILE == 0 and b.shape[-2] % TILE == 0


def _tile_column_ends(ends: Sequence[int], num_tiles: int) -> list[int]:
    """The cumulative ends, in columns of the 128x1 tiling, of each group's tiles (`group_tiles`: a group's
    rows padded to whole tiles, the tiles past the groups the last group's)."""
    tiles, start = [], 0
    for end in ends:
        tiles.append((tiles[-1] if tiles else 0) + _ceil_div(end - start, TILE))
        start = end
    tiles[-1] = num_tiles
    return [t * TILE for t in tiles]


def _group_slices(ends: Sequence[int]) -> Iterator[tuple[int, slice]]:
    """(group, its slice) of every non-empty group, from the groups' cumulative ends."""
    start = 0
    for group, stop in enumerate(ends):
        if stop > start:
            yield group, slice(start, stop)
        start = stop


def _group(b: Fp8Tensor, group: int) -> Fp8Tensor:
    return Fp8Tensor(b.data[group], b.scale[group], b.block_rows)


def _kernel_rows(a: Fp8Tensor, rows: slice) -> Fp8Tensor:
    """Rows `rows` of a 1x128-tiled matrix, zero rows (scale 1) appended up to the kernel's row multiple."""
    data, scale = a.data[rows], a.scale[rows]
    missing = -data.shape[0] % KERNEL_ROWS
    if missing:
        data = torch.cat([data, data.new_zeros(missing, data.shape[1])])
        scale = torch.cat([scale, scale.new_ones(missing, scale.shape[1])])
    return Fp8Tensor(data, scale, 1)


def _tile_columns(q: Fp8Tensor, columns: slice) -> Fp8Tensor:
    """Columns `columns` (whole 128-wide tiles) of a 1x128-tiled matrix, with their scales."""
    return Fp8Tensor(q.data[:, columns], q.scale[:, columns.start // TILE:columns.stop // TILE], 1)


def _has_blockwise_scaled_mm() -> bool:
    scaling = getattr(F, "ScalingType", None)
    return hasattr(F, "scaled_mm") and all(
        hasattr(scaling, name) for name in ("BlockWise1x128", "BlockWise128x128"))


def _kernel_takes(a: Fp8Tensor, b: Fp8Tensor) -> bool:
    """The shapes torch's blockwise kernel is used for: whole 128-wide K tiles, whole 128-row weight
    blocks, 16-aligned rows; everything else is emulated."""
    return (a.data.dim() == b.data.dim() == 2 and a.shape[-1] % TILE == 0 and a.shape[0] % KERNEL_ROWS == 0
            and b.shape[0] % (TILE if b.block_rows == TILE else KERNEL_ROWS) == 0)


def _torch_blockwise_mm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """torch's `scaled_mm` in the layouts its blockwise recipes take: a row-major and b column-major (a
    transposed weight, the Dgrad's, is copied into that layout); a 1x128 scale [M, K/128] column-major;
    a 128x128 scale [K/128 rounded up to 4, N/128] column-major (padded with ones)."""
    scaling = F.ScalingType
    scale_a = a.scale.t().contiguous().t()
    if b.block_rows == TILE:
        k_blocks = b.scale.shape[1]
        scale_b = F.pad(b.scale, (0, _ceil_div(k_blocks, 4) * 4 - k_blocks), value=1.0).t()
        recipe_b = scaling.BlockWise128x128
    else:
        scale_b, recipe_b = b.scale.t().contiguous().t(), scaling.BlockWise1x128
    return F.scaled_mm(a.data.contiguous(), b.data.contiguous().t(), scale_a, scaling.BlockWise1x128, scale_b,
                       recipe_b, output_dtype=out_dtype)


def blockwise_scaled_mm_supported(device: torch.device | str, out_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether torch's blockwise FP8 `scaled_mm` runs on `device` with `out_dtype` output and agrees
    with the emulation, for both recipes the GEMMs use (1x128 x 128x128 and 1x128 x 1x128), a weight and
    a transposed weight. Probed once per device and output dtype on a tiny input; a refusal (the CPU
    build's, or a GPU's without sm_90 support) means False."""
    device = torch.device(device)
    return _probe_blockwise_kernel(device.type, device.index, out_dtype)


def fp8_gemm_backend(device: torch.device | str) -> str:
    """One line for the start-up log: which FP8 GEMMs run torch's kernel on `device` and which the emulation."""
    if not blockwise_scaled_mm_supported(device):
        return f"torch's blockwise FP8 scaled_mm does not run on {device}; the FP8 GEMMs are emulated (exact, slower)"
    weight_grads = ("the weight gradients too (fp32 output)" if blockwise_scaled_mm_supported(device, torch.float32)
                    else "the weight gradients are emulated (the kernel gives no fp32 output here)")
    return (f"the FP8 GEMMs run torch's blockwise scaled_mm on {device}, {weight_grads}; the routed experts' grouped "
            "GEMMs one kernel GEMM per expert, on the dispatcher's host counts; shapes the "
            "kernel does not take (K not a multiple of 128, weights not of 128 rows) are emulated")


@functools.cache
def _probe_blockwise_kernel(device_type: str, index: int | None, out_dtype: torch.dtype) -> bool:
    if not _has_blockwise_scaled_mm():
        return False
    gen = torch.Generator().manual_seed(0)

    def tiled_randn(rows: int, cols: int) -> torch.Tensor:
        """Gaussian with a different power-of-two magnitude per 1x128 tile, so a misplaced scale shows."""
        magnitudes = torch.exp2(torch.randint(-4, 5, (rows, cols // TILE), generator=gen).float())
        values = torch.randn(rows, cols, generator=gen) * magnitudes.repeat_interleave(TILE, dim=1)
        return values.to(torch.device(device_type, index))

    # quantize_tiles itself: the probe may first run inside a GEMM, where the named quantizers are in use
    a = quantize_tiles(tiled_randn(128, 256), 1)
    weight = tiled_randn(256, 256)
    blocks = quantize_tiles(weight, TILE)
    try:
        for b in (blocks, blocks.t(), quantize_tiles(weight, 1)):
            got = _torch_blockwise_mm(a, b, out_dtype).float()
            want = emulated_fp8_mm(a, b, torch.float32)
            if not torch.allclose(got, want, rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item()):
                return False
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


def _flat_rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _saved(q: Fp8Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """An FP8 tensor as the two tensors `save_for_backward` takes (None, None when not needed)."""
    return (None, None) if q is None else (q.data, q.scale)


WeightGradSink = Callable[[torch.Tensor, Callable[[], torch.Tensor]], None]
"""Takes a weight and a function computing its gradient: the pipeline's W store runs it later (the
split backward: parallel.pipeline.wgrad); None computes the gradient in the backward."""


def _columns(rows: torch.Tensor, power_of_two_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The E4M3 data and scales of `rows` in the 128x1 tiling (what an FP8 Linear keeps of its input)."""
    q = quantize_128x1(rows, power_of_two_scale)
    return q.data, q.scale


def _linear_weight_grad(grad_rows: torch.Tensor, x_columns: Fp8Tensor, power_of_two_scale: bool) -> torch.Tensor:
    """Wgrad in FP8: grad_y^T x from grad_y and x both in 128x1 tiles, fp32."""
    return fp8_mm(quantize_128x1(grad_rows, power_of_two_scale), x_columns, torch.float32)


def _grouped_weight_grad(grad_y: torch.Tensor, groups: GroupEnds, x_columns: Fp8Tensor,
                         tile_groups: torch.Tensor, power_of_two_scale: bool) -> torch.Tensor:
    grad_columns, _ = quantize_128x1_grouped(grad_y, groups.offsets, power_of_two_scale)
    return fp8_grouped_weight_grad(grad_columns, x_columns, groups, tile_groups)


def _weight_grad(ctx, compute: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """The weight gradient in the weight's dtype now, or None when `ctx.sink` takes it for later."""
    if ctx.sink is not None:
        ctx.sink(ctx.weight, compute)
        return None
    return compute().to(ctx.weight.dtype)


class Fp8LinearFunction(torch.autograd.Function):
    """y = x W^T with its three GEMMs in FP8: Fprop (x 1x128, W 128x128), Dgrad (grad_y 1x128, W^T
    128x128), Wgrad (grad_y and x in 128x1 tiles; handed to `sink` when given). Saves x in the
    128x1 tiling and W in FP8; where x is the output of one of `recompute`'s regions (a recomputed
    norm), the 128x1 copy is rebuilt from the region's replay instead (`Recompute.derived`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, ops: Fp8GemmOps,
                recompute: Recompute | None) -> torch.Tensor:
        rows, power_of_two_scale = _flat_rows(x), ops.power_of_two_scales
        weight_q = ops.quantized_weight(weight)
        columns = (None, None)
        if weight.requires_grad:
            quantize = functools.partial(_columns, power_of_two_scale=power_of_two_scale)
            columns = recompute.derived(quantize, rows) if recompute is not None else quantize(rows)
        ctx.save_for_backward(weight_q.data, weight_q.scale, *columns)
        ctx.power_of_two_scale, ctx.x_dtype, ctx.weight, ctx.sink = power_of_two_scale, x.dtype, weight, ops.sink
        ctx.grad_power_of_two = ops.power_of_two_for(output_grads=True)
        y = fp8_mm(quantize_1x128(rows, ops.power_of_two_for(inputs=True)), weight_q, gemm_dtype(x, weight))
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        weight_data, weight_scale, x_data, x_scale = ctx.saved_tensors
        grad_rows = _flat_rows(grad_y)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            weight_t = Fp8Tensor(weight_data, weight_scale, TILE).t()
            grad_x = fp8_mm(quantize_1x128(grad_rows, ctx.grad_power_of_two), weight_t, ctx.x_dtype)
            grad_x = grad_x.reshape(*grad_y.shape[:-1], weight_data.shape[1])
        if x_data is not None:
            grad_w = _weight_grad(ctx, functools.partial(_linear_weight_grad, grad_rows, Fp8Tensor(x_data, x_scale, 1),
                                                         ctx.power_of_two_scale))
        return grad_x, grad_w, None, None


class Fp8GroupedLinearFunction(torch.autograd.Function):
    """y_g = x_g W_g^T per group (rows sorted by group, ending at `groups`) with its three
    GEMMs in FP8; the 128x1 tiles of the Wgrad restart at each group (`quantize_128x1_grouped`).
    Fprop takes `x_fp8` as x's 1x128 quantization when given (the FP8 dispatch's rows), not
    quantizing x then; x stays the differentiable input and the source of the Wgrad's 128x1 tiles."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, groups: GroupEnds, ops: Fp8GemmOps,
                x_fp8: Fp8Tensor | None = None) -> torch.Tensor:
        power_of_two_scale, sink = ops.power_of_two_scales, ops.sink
        weight_q = ops.quantized_weight(weight)
        x_columns, tile_groups = None, None
        if weight.requires_grad:
            x_columns, tile_groups = quantize_128x1_grouped(x, groups.offsets, power_of_two_scale)
        ctx.save_for_backward(weight_q.data, weight_q.scale, tile_groups, *_saved(x_columns))
        ctx.groups, ctx.power_of_two_scale, ctx.x_dtype = groups, power_of_two_scale, x.dtype
        ctx.weight, ctx.sink = weight, sink
        ctx.grad_power_of_two = ops.power_of_two_for(output_grads=True)
        if x_fp8 is None:
            x_fp8 = quantize_1x128(x, ops.power_of_two_for(inputs=True))
        return fp8_grouped_mm(x_fp8, weight_q, groups, gemm_dtype(x, weight))

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        weight_data, weight_scale, tile_groups, x_data, x_scale = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            weight_t = Fp8Tensor(weight_data, weight_scale, TILE).t()
            grad_x = fp8_grouped_mm(quantize_1x128(grad_y, ctx.grad_power_of_two), weight_t, ctx.groups, ctx.x_dtype)
        if x_data is not None:
            grad_w = _weight_grad(ctx, functools.partial(
                _grouped_weight_grad, grad_y.contiguous(), ctx.groups, Fp8Tensor(x_data, x_scale, 1), tile_groups,
                ctx.power_of_two_scale))
        return grad_x, grad_w, None, None, None


class Fp8ActivatedFunction(torch.autograd.Function):
    """y = activation(x[, row_weights]) W^T, a SwiGLU's down projection as DeepSeek-V3 runs the MoE's
    (§3.3.3): x (the gate/up output) is cached in FP8, 1x128 tiles, and the activation's output, the
    GEMM's input, is not kept but recomputed in backward from the dequantized cache. With `groups`
    the routed experts' (one weight per group, rows sorted by group, each row scaled by its router
    weight: `Fp8GroupedLinearFunction`'s GEMMs), without the shared expert's (one weight, no row
    weights: `Fp8LinearFunction`'s). The weight gradient's 128x1 operand is quantized from the
    recomputed activation. The forward computes the activation from x itself, so the cache's rounding
    reaches the gradients only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, row_weights: torch.Tensor | None, weight: torch.Tensor,
                groups: GroupEnds | None, activation: Callable[..., torch.Tensor], ops: Fp8GemmOps) -> torch.Tensor:
        weight_q = ops.quantized_weight(weight)
        rows = _flat_rows(x)
        cache = quantize_1x128(rows, ops.power_of_two_scales)
        hidden = _activate(activation, rows, row_weights)
        ctx.save_for_backward(cache.data, cache.scale, row_weights, weight_q.data, weight_q.scale)
        ctx.groups, ctx.activation, ctx.x_dtype, ctx.weight, ctx.sink = groups, activation, x.dtype, weight, ops.sink
        ctx.x_shape = x.shape
        ctx.power_of_two_scale = ops.power_of_two_scales
        ctx.grad_power_of_two = ops.power_of_two_for(output_grads=True)
        y = _fp8_gemm(quantize_1x128(hidden, ops.power_of_two_for(inputs=True)), weight_q, groups,
                      gemm_dtype(hidden, weight))
        return y.reshape(*x.shape[:-1], weight.shape[-2])

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        cache_data, cache_scale, row_weights, weight_data, weight_scale = ctx.saved_tensors
        with torch.enable_grad():
            x = dequantize(Fp8Tensor(cache_data, cache_scale, 1), ctx.x_dtype).requires_grad_()
            if row_weights is not None:
                row_weights = row_weights.detach().requires_grad_(ctx.needs_input_grad[1])
            hidden = _activate(ctx.activation, x, row_weights)
        grad_y = _flat_rows(grad_y).contiguous()
        weight_t = Fp8Tensor(weight_data, weight_scale, TILE).t()
        grad_hidden = _fp8_gemm(quantize_1x128(grad_y, ctx.grad_power_of_two), weight_t, ctx.groups, hidden.dtype)
        grad_w = None
        if ctx.needs_input_grad[2]:
            # the rebuilt activation's 128x1 tiles are bound only in the partial: once a weight
            # gradient computed now is done they are freed, before the SwiGLU's backward below
            if ctx.groups is None:
                compute = functools.partial(_linear_weight_grad, grad_y, quantize_128x1(hidden.detach(),
                                                                                     ctx.power_of_two_scale),
                                            ctx.power_of_two_scale)
            else:
                compute = functools.partial(
                    _grouped_weight_grad, grad_y, ctx.groups,
                    *quantize_128x1_grouped(hidden.detach(), ctx.groups.offsets, ctx.power_of_two_scale),
                    ctx.power_of_two_scale)
            grad_w = _weight_grad(ctx, compute)
        inputs = (x, row_weights) if row_weights is not None and row_weights.requires_grad else (x,)
        grads = torch.autograd.grad(hidden, inputs, grad_hidden)
        return grads[0].reshape(ctx.x_shape), grads[1] if len(grads) > 1 else None, grad_w, None, None, None


def _activate(activation: Callable[..., torch.Tensor], x: torch.Tensor, row_weights: torch.Tensor | None) -> torch.Tensor:
    return activation(x) if row_weights is None else activation(x, row_weights)


def _fp8_gemm(a: Fp8Tensor, weight: Fp8Tensor, groups: GroupEnds | None, out_dtype: torch.dtype) -> torch.Tensor:
    """a W^T: one weight (groups None) or one per group of a's rows."""
    return fp8_mm(a, weight, out_dtype) if groups is None else fp8_grouped_mm(a, weight, groups, out_dtype)


@dataclass
class _StepWeights:
    """The FP8 copies of the weights made in the current `weights_fixed` scope (None outside one)."""

    copies: dict[int, Fp8Tensor] | None = None


class Fp8GemmOps(GemmOps):
    """Every weight GEMM in FP8 E4M3 with fine-grained scales. The output is in `gemm_dtype` (bf16 with
    bf16 parameters), the input gradient in the input's dtype, the weight gradient in the weight's.
    `sink` defers the weight gradients (the pipeline's split backward); the output head keeps
    `high_precision` GEMMs, as DeepSeek-V3 keeps it in BF16.

    Inside `weights_fixed()` (one optimizer step's forwards and backwards) each weight is quantized
    once and its FP8 copy shared by every micro-batch, instead of one copy saved per micro-batch in
    flight; the copies are dropped when the scope ends, before the optimizer changes the weights.

    `at_dispatch_boundary` gives the routed experts' GEMMs power-of-two scales where the FP8 dispatch
    quantizes the same rows (their gate/up input, their down projection's output gradient): a row the
    dispatch quantized and the receiver dequantized (exactly, the scale being a power of two) then
    quantizes to the same values (the same codes and scale, or, where a tile's largest value rounded
    down to 224, half the scale and doubled codes), so the GEMM computes with the dispatched payload's
    values, and one process quantizes these inputs as an EP layout does.

    The gate/up GEMM then takes the dispatched rows themselves (`grouped`'s `x_fp8`) and skips that
    second quantization. The dispatched rows dequantize to the values x has, bit for bit, and the two
    tilings differ only by powers of two (exact in the scales and the products): so the output is the
    one quantizing x gives, for every tile. That includes the tiles whose amax is under the dispatch's amax floor (1e-4, DeepEP's
    rule, parallel.dispatch.fp8), which travel with scale 2^-22 where quantizing x picks a power of
    two no larger (scale 1 for a zero tile): other codes and scale, the same values (a code times 2^k
    stays an E4M3 code, and that scale keeps it within 448), zeros staying zeros."""

    def __init__(self, power_of_two_scales: bool = False, sink: WeightGradSink | None = None,
                 high_precision: GemmOps | None = None) -> None:
        self.power_of_two_scales, self.sink = power_of_two_scales, sink
        self.power_of_two_inputs = self.power_of_two_output_grads = False
        self._high_precision = high_precision or GemmOps()
        self._step = _StepWeights()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, recompute: Recompute | None = None) -> torch.Tensor:
        return Fp8LinearFunction.apply(x, weight, self, recompute)

    def grouped(self, x: torch.Tensor, weight: torch.Tensor, groups: GroupEnds,
                x_fp8: Fp8Tensor | None = None) -> torch.Tensor:
        """`x_fp8`: the FP8 dispatch's rows that x was dequantized from, which Fprop takes instead of
        quantizing x (see the class docstring for why the output is the same); needs power-of-two
        input scales, as `at_dispatch_boundary(inputs=True)` gives."""
        if x_fp8 is not None and not (self.power_of_two_for(inputs=True) and x_fp8.block_rows == 1
                                      and x_fp8.shape == x.shape):
            raise ValueError("pre-quantized rows must be x's 1x128 tiles, taken by GEMMs whose input scales are "
                             f"powers of two: rows {tuple(x_fp8.shape)} in {x_fp8.block_rows}-row tiles for x "
                             f"{tuple(x.shape)}, power-of-two inputs {self.power_of_two_for(inputs=True)}")
        return Fp8GroupedLinearFunction.apply(x, weight, groups, self, x_fp8)

    def grouped_activated(self, activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
                          row_weights: torch.Tensor, weight: torch.Tensor, groups: GroupEnds,
                          recompute: Recompute) -> torch.Tensor:
        """The activation's input cached in FP8 and its output recomputed, whatever `recompute` holds
        (DeepSeek-V3's FP8 recipe always does: `Fp8ActivatedFunction`)."""
        return Fp8ActivatedFunction.apply(x, row_weights, weight, groups, activation, self)

    def linear_activated(self, activation: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                         weight: torch.Tensor, recompute: Recompute | None) -> torch.Tensor:
        """The shared expert's as the routed experts' (`grouped_activated`)."""
        return Fp8ActivatedFunction.apply(x, None, weight, None, activation, self)

    def high_precision(self) -> GemmOps:
        return self._high_precision

    def at_dispatch_boundary(self, inputs: bool = False, output_grads: bool = False) -> Fp8GemmOps:
        boundary = copy.copy(self)  # the same sink and step weights
        boundary.power_of_two_inputs, boundary.power_of_two_output_grads = inputs, output_grads
        return boundary

    def power_of_two_for(self, inputs: bool = False, output_grads: bool = False) -> bool:
        """Whether the 1x128 quantization of the inputs (or of the output gradients) uses power-of-two scales."""
        return self.power_of_two_scales or (inputs and self.power_of_two_inputs) or (
            output_grads and self.power_of_two_output_grads)

    def quantized_weight(self, weight: torch.Tensor) -> Fp8Tensor:
        """`weight` in 128x128 blocks: the step's shared copy inside `weights_fixed`, else a fresh one."""
        copies = self._step.copies
        if copies is None:
            return quantize_128x128(weight, self.power_of_two_scales)
        if id(weight) not in copies:
            copies[id(weight)] = quantize_128x128(weight, self.power_of_two_scales)
        return copies[id(weight)]

    @contextlib.contextmanager
    def weights_fixed(self) -> Iterator[None]:
        self._step.copies = {}
        try:
            yield
        finally:
            self._step.copies = None
