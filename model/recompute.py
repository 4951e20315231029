"""Selective recomputation (`model.recompute_modules`): activations that are cheap to rebuild are not
stored for the backward; the backward rebuilds them from what is kept.

DeepSeek-V3 (report §3.2.3) recomputes every RMSNorm and the MLA up-projections in backward, and
(§3.3.3) keeps the SwiGLU input of the experts and recomputes its output. Megatron's names:

- `layernorm`: the four RMSNorms of a decoder layer (input, post-attention, and MLA's q and kv
  latent norms). Neither their outputs nor their internals are stored; each keeps only its input.
  Nor is the router's fp32 copy of the post-attention norm's output (with bf16 parameters).
- `mla_up_proj`: the query and key-value up-projections (`q_b_proj`, or `q_proj` without a q LoRA,
  and `kv_b_proj`), the RoPE of q and k and the values' zero padding: q, k and v, which the
  attention core saves, are rebuilt from the latents.
- `moe_act`: the routed experts' SwiGLU and router-weight scaling, and the shared expert's SwiGLU:
  the down projections' inputs and the activations' internals are rebuilt from the gate/up
  projections' outputs.
- `full`: the whole decoder layer, keeping only its input (torch.utils.checkpoint); alone.

How: a decoder layer's forward runs inside `Recompute.active()`, a saved-tensors hook pair. A
region (`Recompute.region`) runs its function and records its outputs' storages. When a later op of
the layer saves such an output, or a view of it, for its backward, the hook keeps a recipe instead
of the tensor; unpacking it in backward runs the region again under the forward's autocast state,
once for all the tensors that need it, and returns the same view of the new output. A region whose
internals are large too (a norm, the activation) runs as a non-reentrant checkpoint, so its own
backward rebuilds them from its inputs. A region's input that is another region's output (the q
latent norm feeding the up-projection) is kept as a recipe as well. What a GEMM derives from a
region's output for its backward (an FP8 Linear's quantized copy of a norm's output, model.fp8) is
a recipe too when it goes through `Recompute.derived`: rebuilt from the region's replay (so is the
router's fp32 copy of the norm's output that its logits' GEMM saves).

A replay computes exactly the forward's values from the same inputs, so fp32 gradients are
bit-identical to no recomputation. No region contains the router, a dispatch or a combine: a
recomputation never routes, never communicates, and cannot route a token differently.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from model.args import SELECTIVE_RECOMPUTE

# Regions whose internals are as large as their outputs (a norm's fp32 statistics and normalised
# input, the activation's gate, SiLU and product) are checkpointed; the up-projection's internals are
# its small latent inputs, and checkpointing it would run its GEMMs twice.
CHECKPOINTED = {"layernorm": True, "mla_up_proj": False, "moe_act": True}


class _Recipe:
    """How to rebuild one region's outputs: its function, its inputs (packed, so an input that is
    another region's output stays a recipe) and the forward's autocast state. The rebuilt outputs
    are cached from the first unpack until every saved view of them has been unpacked."""

    def __init__(self, fn: Callable[..., Any], inputs: list[Any], autocast: tuple[str, bool, torch.dtype]) -> None:
        self.fn, self.inputs, self.autocast = fn, inputs, autocast
        self.pending = 0
        self._outputs: tuple[torch.Tensor, ...] | None = None

    def output(self, index: int) -> torch.Tensor:
        if self._outputs is None:
            device, enabled, dtype = self.autocast
            with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                rebuilt = self.fn(*(_unpack(x) for x in self.inputs))
            self._outputs = rebuilt if isinstance(rebuilt, tuple) else (rebuilt,)
        value = self._outputs[index]
        self.pending -= 1
        if self.pending <= 0:
            self._outputs = None
        return value


@dataclass(frozen=True)
class _SavedView:
    """What an op saved in place of a region's output: which output, and the view of it it saved."""

    recipe: _Recipe
    index: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class _Expanded:
    """What an op saved in place of its output, kept as a compact tensor its readers keep anyway: the
    output is rebuilt into a tensor laid out as the op's output was, by `expand(compact, into)`."""

    compact: torch.Tensor
    expand: Callable[[torch.Tensor, torch.Tensor], None]
    size: torch.Size
    stride: tuple[int, ...]

    def output(self) -> torch.Tensor:
        out = torch.empty_strided(self.size, self.stride, dtype=self.compact.dtype, device=self.compact.device)
        self.expand(self.compact, out)
        return out


class _Box:
    """A tensor an op saved while `Recompute.compact_saved_output` runs it, packed once the op has returned."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _unpack(saved: Any) -> Any:
    if isinstance(saved, _Box):
        return _unpack(saved.value)
    if isinstance(saved, _SavedView):
        return saved.recipe.output(saved.index).as_strided(saved.size, saved.stride, saved.offset)
    if isinstance(saved, _Expanded):
        return saved.output()
    return saved


class Recompute:
    """The recomputation of one decoder layer: which of SELECTIVE_RECOMPUTE it recomputes, and while
    its forward runs (`active`), the storages of the region outputs recorded so far."""

    def __init__(self, modules: Iterable[str]) -> None:
        self.modules = frozenset(modules) & set(SELECTIVE_RECOMPUTE)
        self._outputs: dict[int, tuple[StorageWeakRef, _Recipe, int]] | None = None
        # storages of the compact tensors that ops' backwards keep in place of their outputs
        self._compact: dict[int, StorageWeakRef] = {}

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run a forward whose regions are recomputed (a no-op without modules or without grad)."""
        if not self.modules or not torch.is_grad_enabled():
            yield
            return
        self._outputs = {}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield
        finally:
            self._outputs, self._compact = None, {}

    def region(self, module: str, fn: Callable[..., Any], *inputs: Any) -> Any:
        """fn(*inputs), rebuilt in backward where `module` is recomputed and a forward is active."""
        if module not in self.modules or self._outputs is None:
            return fn(*inputs)
        out = checkpoint(fn, *inputs, use_reentrant=False) if CHECKPOINTED[module] else fn(*inputs)
        self._record(fn, inputs, out)
        return out

    def derived(self, fn: Callable[..., Any], *inputs: Any) -> Any:
        """fn(*inputs), a deterministic function that saves nothing itself (an FP8 GEMM's quantization of
        its input for the backward, where grad is off; the router's cast to fp32): when an input is a region's
        output, so that the region's replay rebuilds it, its outputs are rebuilt from that replay
        instead of kept; when it is the compact tensor an op keeps of its output
        (`compact_saved_output`), from that tensor. An FP8 Linear's copy of a recomputed norm's output
        then costs nothing until the backward, as the norm's output itself, and o_proj's copy of the
        attention core's output nothing beside what the core keeps."""
        out = fn(*inputs)
        if self._outputs is not None and any(self._region_output(x) is not None or self._is_compact(x)
                                             for x in inputs):
            self._record(fn, inputs, out)
        return out

    def compact_saved_output(self, module: str, op: Callable[[], torch.Tensor],
                             compact: Callable[[torch.Tensor], torch.Tensor],
                             expand: Callable[[torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
        """compact(op()), where `compact` makes a new, smaller tensor of op's output from which
        `expand(compact, into)` writes the output bit for bit into a tensor of the output's size and
        strides (the attention core's output without v's zero padding). Where
        `module` is recomputed, what op saves of its output for its backward is the compact tensor,
        which its readers keep anyway (o_proj's input), instead of the output itself; the rest op saves
        is packed as the layer's other saved tensors are."""
        if module not in self.modules or self._outputs is None:
            return compact(op())
        boxes: list[_Box] = []

        def pack(tensor: torch.Tensor) -> _Box:
            boxes.append(_Box(tensor))
            return boxes[-1]

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            out = op()
        small = compact(out)
        out_key = StorageWeakRef(out.untyped_storage()).cdata
        replaced = False
        for box in boxes:
            tensor = box.value
            if (StorageWeakRef(tensor.untyped_storage()).cdata == out_key and tensor.shape == out.shape
                    and tensor.stride() == out.stride() and tensor.storage_offset() == out.storage_offset()):
                box.value = _Expanded(small, expand, tensor.size(), tensor.stride())
                replaced = True
            else:
                box.value = self._pack(tensor)
        if replaced:  # what derives from `small` is then rebuilt from it (a backend that saves no output: kept)
            ref = StorageWeakRef(small.untyped_storage())
            self._compact[ref.cdata] = ref
        return small

    def _record(self, fn: Callable[..., Any], inputs: tuple[Any, ...], out: Any) -> None:
        """Remember `out`'s storages as outputs of a recipe that reruns fn on the (packed) inputs."""
        tensors = out if isinstance(out, tuple) else (out,)
        device = tensors[0].device.type
        recipe = _Recipe(fn, [self._pack(x) for x in inputs],
                         (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)))
        for index, tensor in enumerate(tensors):
            ref = StorageWeakRef(tensor.untyped_storage())
            self._outputs[ref.cdata] = (ref, recipe, index)

    def _region_output(self, tensor: Any) -> tuple[StorageWeakRef, _Recipe, int] | None:
        """The recorded output whose storage `tensor` shares, if any (alive)."""
        if not isinstance(tensor, torch.Tensor) or self._outputs is None:
            return None
        entry = self._outputs.get(StorageWeakRef(tensor.untyped_storage()).cdata)
        return None if entry is None or entry[0].expired() else entry

    def _is_compact(self, tensor: Any) -> bool:
        """Whether `tensor` shares the storage of a compact tensor kept in place of an op's output."""
        if not isinstance(tensor, torch.Tensor):
            return False
        ref = self._compact.get(StorageWeakRef(tensor.untyped_storage()).cdata)
        return ref is not None and not ref.expired()

    def _pack(self, tensor: Any) -> Any:
        entry = self._region_output(tensor)
        if entry is None:
            return tensor
        _, recipe, index = entry
        recipe.pending += 1
        return _SavedView(recipe, index, tensor.size(), tensor.stride(), tensor.storage_offset())
