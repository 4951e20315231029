"""Contiguous parameter and gradient buffers in buckets: the memory the data-parallel exchange moves.

As Megatron's distributed data parallel with its distributed optimizer. A rank's parameters are
grouped by the ranks that hold the same copy of them (a `ReplicaGroup`: dense parameters over dp,
routed experts over expert-dp, the copies another pipeline rank also holds over that pair x dp),
and each group's parameters are laid out, in the order their gradients become final, in buckets
of at least `bucket_elements` elements (a parameter is never cut between two buckets). A bucket
owns two flat tensors: the parameters' values in the compute dtype (each parameter's `.data` is a
view of it) and their fp32 gradients (each parameter's `main_grad` is a view of it; autograd's
gradients fold into it: parallel.mixed_precision).

With ZeRO-1 (`shard`) a bucket is padded with zeros to a multiple of its group's size and cut
evenly: member i owns elements [i S, (i + 1) S). Its gradients are reduce-scattered (each member
receives the sum over the group of its own range), the owner's optimizer steps that range, and the
parameters are all-gathered, every collective in place on the bucket's tensors. Without ZeRO-1
each member owns the whole bucket and all-reduces its gradients. Per step and rank that is, for N
elements over D members, a reduce-scatter of 4N and an all-gather of bN bytes (b: the parameters'
bytes), each sending (D - 1)/D of it, against 2(D - 1)/D x 4N for the all-reduce and (D - 1)/D x bN
for the owners' broadcasts that ZeRO-1 used before: 0.6 of it with bf16 parameters, 2/3 with fp32.
`sent_bytes` counts each collective as it is issued, as the ring algorithms send it.

The range of a parameter that a rank owns, with its fp32 main value, is a `Piece`: what the
optimizer steps, what the gradient norm adds up and what a checkpoint saves
(parallel.sharded_state). A bf16 parameter's main value is an fp32 copy of the owned range,
made from the parameter's fp32 value before the cast, so it starts exact; an fp32 parameter's is a
view of the parameter itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from parallel.mixed_precision import attach_main_grad

# Megatron's default bucket size (--ddp-bucket-size): large enough that a collective runs at bandwidth.
DEFAULT_BUCKET_ELEMENTS = 40_000_000

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # newer name where there is one


@dataclass(frozen=True)
class ReplicaGroup:
    """Ranks that hold the same copy of some parameters: their gradients are reduced over it."""

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int  # this rank's index in it

    @staticmethod
    def of(group: Optional[dist.ProcessGroup]) -> "ReplicaGroup":
        if group is None:
            return LOCAL
        return ReplicaGroup(group, dist.get_world_size(group), dist.get_rank(group))


LOCAL = ReplicaGroup(None, 1, 0)


@dataclass
class Piece:
    """Elements [start, stop) of the flattened parameter `name` that this rank's optimizer steps."""

    name: str
    param: nn.Parameter
    start: int
    stop: int
    main: torch.Tensor  # fp32, 1-D: the main parameter's values (a view of `param` when it is fp32)
    grad: torch.Tensor  # fp32, 1-D: a view of the bucket's gradients


class Bucket:
    """Parameters of one replica group laid out in two flat tensors; see the module docstring."""

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]], group: ReplicaGroup, shard: bool,
                 dtype: torch.dtype) -> None:
        self.names = [name for name, _ in named]
        self.params = [param for _, param in named]
        self.group, self.shard = group, shard
        self.starts, total = [], 0
        for param in self.params:
            self.starts.append(total)
            total += param.numel()
        members = group.size if shard else 1
        padded = -(-total // members) * members
        device = self.params[0].device
        self.data = torch.zeros(padded, dtype=dtype, device=device)
        self.grad = torch.zeros(padded, dtype=torch.float32, device=device)
        size = padded // members
        first = group.rank * size if shard else 0
        self.owned = range(first, first + size)
        self._work: Optional[dist.Work] = None

    def adopt(self) -> list[Piece]:
        """Move the parameters into `data` (cast to its dtype) and give each its fp32 `main_grad` in
        `grad`; returns the pieces this rank owns, their main values taken before the cast."""
        pieces = []
        for name, param, start in zip(self.names, self.params, self.starts):
            stop = start + param.numel()
            low, high = max(start, self.owned.start), min(stop, self.owned.stop)
            values = param.detach().reshape(-1)
            main = values[low - start:high - start].to(torch.float32, copy=True) if low < high else None
            self.data[start:stop].copy_(values)
            param.data = self.data[start:stop].view(param.shape)
            attach_main_grad(param, self.grad[start:stop].view(param.shape))
            if main is not None:
                if self.data.dtype == torch.float32:
                    main = self.data[low:high]
                param.main_piece = Piece(name, param, low - start, high - start, main, self.grad[low:high])
                pieces.append(param.main_piece)
        return pieces

    def _sent(self, kind: str, tensor: torch.Tensor, passes: int = 1) -> dict[str, int]:
        """What this rank sends of `tensor` in a ring collective over the group: (D - 1)/D per pass."""
        members = self.group.size
        return {kind: passes * (members - 1) * tensor.numel() * tensor.element_size() // members}

    def collective_bytes(self) -> dict[str, int]:
        """Bytes this rank sends per step for this bucket, by collective (as `start_reduction` and
        `gather_parameters` count them)."""
        if self.group.size == 1:
            return {}
        if not self.shard:
            return self._sent("all_reduce", self.grad, passes=2)
        return {**self._sent("reduce_scatter", self.grad), **self._sent("all_gather", self.data)}

    def start_reduction(self) -> dict[str, int]:
        """Start summing the gradients over the group (asynchronously): each member's owned range.
        Returns the bytes sent, by collective."""
        if self.group.size == 1 or self._work is not None:
            return {}
        if self.shard:
            self._work = _reduce_scatter(self.grad[self.owned.start:self.owned.stop], self.grad,
                                         group=self.group.group, async_op=True)
            return self._sent("reduce_scatter", self.grad)
        self._work = dist.all_reduce(self.grad, group=self.group.group, async_op=True)
        return self._sent("all_reduce", self.grad, passes=2)

    @property
    def started(self) -> bool:
        return self._work is not None or self.group.size == 1

    def finish_reduction(self, scale: float) -> None:
        """Wait for the reduction and scale the owned gradients by `scale`."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        if scale != 1.0:
            self.grad[self.owned.start:self.owned.stop].mul_(scale)

    def gather_parameters(self) -> dict[str, int]:
        """After the owners' step: every member receives the others' updated ranges (ZeRO-1). Returns
        the bytes sent."""
        if not self.shard or self.group.size == 1:
            return {}
        all_gather_flat(self.data, self.data[self.owned.start:self.owned.stop], group=self.group.group)
        return self._sent("all_gather", self.data)

    def counts_in_norm(self) -> bool:
        """Whether this rank adds its owned gradients to the global norm: each element once per job."""
        return self.shard or self.group.rank == 0


def cut_into_buckets(named: Sequence[tuple[str, nn.Parameter]], bucket_elements: int) -> list[list[tuple[str, nn.Parameter]]]:
    """Consecutive runs of `named`, each closed once it holds at least `bucket_elements` elements."""
    buckets, current, size = [], [], 0
    for item in named:
        current.append(item)
        size += item[1].numel()
        if size >= bucket_elements:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class ParamBuffers:
    """Every trainable parameter of a model in buckets, and what this rank owns of them.

    `groups`: (parameters in the order their gradients become final, their replica group), each
    parameter of the model in exactly one. `dtype`: the parameters' compute dtype (bf16: the model
    is cast; fp32: unchanged values). `shard`: ZeRO-1. Built once the model is on its device.
    """

    def __init__(self, groups: Sequence[tuple[Sequence[tuple[str, nn.Parameter]], ReplicaGroup]],
                 dtype: torch.dtype, shard: bool, bucket_elements: int = DEFAULT_BUCKET_ELEMENTS) -> None:
        self.buckets: list[Bucket] = []
        self.pieces: list[Piece] = []
        self.bucket_of: dict[int, Bucket] = {}
        for named, group in groups:
            for chunk in cut_into_buckets(named, bucket_elements):
                bucket = Bucket(chunk, group, shard, dtype)
                self.pieces += bucket.adopt()
                self.buckets.append(bucket)
                self.bucket_of.update((id(p), bucket) for p in bucket.params)
        self.sent_bytes: dict[str, int] = {}

    def bytes_per_step(self) -> dict[str, int]:
        """Bytes this rank sends per optimizer step, by collective."""
        total: dict[str, int] = {}
        for bucket in self.buckets:
            for kind, size in bucket.collective_bytes().items():
                total[kind] = total.get(kind, 0) + size
        return total

    def count(self, sent: dict[str, int]) -> None:
        """Add what one collective sent to `sent_bytes`."""
        for kind, size in sent.items():
            self.sent_bytes[kind] = self.sent_bytes.get(kind, 0) + size

    def gather_parameters(self) -> None:
        """All-gather every sharded bucket's parameters (after the optimizer step)."""
        for bucket in self.buckets:
            self.count(bucket.gather_parameters())
