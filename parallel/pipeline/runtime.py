"""The pipeline runtime: executes one rank's lowered program, whatever schedule produced it.

Compute actions call the rank's stages; every `CommBatch` is one `batch_isend_irecv`. Its
receives are waited on at once. Where the backend returns one work per operation (gloo), its
sends are waited on lazily: a send whose receiver is still computing then does not hold this
rank up (a send has completed only once its peer posted the receive); every send is waited on
by the end of the step. Where the batch is one coalesced work (NCCL), it is waited on whole.
Waiting less than the lowering assumes cannot deadlock: it only lets a rank post its next batch
earlier. Activations have one fixed shape and dtype, so receive buffers are allocated without a
shape exchange.

Per (stage, micro-batch): F keeps the stage's input and output; a sent output's storage is
released once its send completed (the autograd graph stays; backward then goes straight to the
autograd engine, as Megatron and DualPipe do, because the public API would reject the emptied
output). B/BW run the backward from the received output gradient (the loss stage: from 1, its loss
being scaled already), inside the W store's scope so B queues its weight-gradient work and BW runs it;
the input gradient is sent, or handed to the local previous stage (the bottom of a V). W pops the
queued work. FB runs its forward half, then its backward half, or, given `fb_overlap`
(`parallel.pipeline.overlap.FBOverlap`), the two interleaved so each hides the other's
all-to-alls. At the end of a step nothing may be left: no activation, gradient, queued W or P2P.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Variable

from .ir import Action, ActionKind, CommBatch, LoweredSchedule, ScheduleError
from .wgrad import WeightGradStore

Key = tuple[int, int]  # (stage, microbatch)


class Stage(Protocol):
    """What the runtime needs from a stage: a forward; the loss stage returns the scalar its backward
    starts from (the loss, times whatever scale the stage applies). Stages keep what they report."""

    def forward(self, microbatch: int, x: Optional[torch.Tensor], inputs: Any) -> torch.Tensor: ...


@dataclass
class _StepState:
    inputs: dict[Key, Optional[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    output_grads: dict[Key, torch.Tensor] = field(default_factory=dict)
    input_grads: dict[Key, torch.Tensor] = field(default_factory=dict)
    live: set[Key] = field(default_factory=set)
    peak: int = 0

    def leftovers(self) -> list[str]:
        held = {"inputs": self.inputs, "outputs": self.outputs, "output grads": self.output_grads,
                "input grads": self.input_grads}
        return [f"{what} {sorted(keys)}" for what, keys in held.items() if keys]


@dataclass
class _PendingSend:
    """A posted send; `work` None: its coalesced batch was waited on already. `release`: an
    activation whose storage goes once the send completed."""

    work: Optional[dist.Work]
    tensor: torch.Tensor
    release: bool


def _backward(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward through the engine directly: `output` may have had its storage released."""
    Variable._execution_engine.run_backward((output,), (grad,), False, False, (), True, True)


class PipelineRuntime:
    """Runs `lowered.programs[pp_rank]` with `stages` (stage id -> Stage) once per `step`.

    `group` is the pipeline process group (None: the default group, pipeline rank = global rank).
    `activation` is the (shape, dtype, device) of every stage-to-stage tensor. `after_compute`, if
    given, is called with every compute action (FB whole) once it has run, e.g. to start the
    reduction of gradients that became final.
    """

    fb_overlap: Optional[Callable[[Callable[[], None], Callable[[], None]], None]] = None  # FB hook

    def __init__(self, lowered: LoweredSchedule, pp_rank: int, stages: dict[int, Stage],
                 store: WeightGradStore, activation: tuple[Sequence[int], torch.dtype, torch.device],
                 group: Optional[dist.ProcessGroup] = None,
                 after_compute: Optional[Callable[[Action], None]] = None) -> None:
        placement = lowered.schedule.placement
        missing = set(placement.stages_on(pp_rank)) - set(stages)
        if missing:
            raise ValueError(f"pipeline rank {pp_rank} runs stages {sorted(missing)} but was not given them")
        self.lowered, self.pp_rank, self.stages, self.store = lowered, pp_rank, stages, store
        self.shape, self.dtype, self.device = tuple(activation[0]), activation[1], activation[2]
        self.group, self.after_compute = group, after_compute
        self.num_stages = lowered.schedule.num_stages
        self.pending_p2p: list[_PendingSend] = []
        self.peak_live = 0
        self.compute_s = 0.0
        self.action_s: dict[ActionKind, list[float]] = {}

    @property
    def schedule_microbatches(self) -> int:
        return self.lowered.schedule.num_microbatches

    def _peer(self, pp_rank: int) -> int:
        return pp_rank if self.group is None else dist.get_global_rank(self.group, pp_rank)

    def _local(self, stage: int, microbatch: int) -> bool:
        return self.lowered.schedule.rank_of(stage, microbatch) == self.pp_rank

    def step(self, inputs: Sequence[Any]) -> None:
        """Run the program on micro-batches `inputs` (what the stages report, e.g. losses, they keep).
        Afterwards `peak_live` is the step's most micro-batch activations held at once (F done, W or BW
        not), `compute_s` the wall time spent in compute actions and `action_s` those times by kind (F,
        B, W, BW; an FB action, whose halves may interleave, is counted as FB)."""
        if len(inputs) != self.schedule_microbatches:
            raise ValueError(f"{len(inputs)} micro-batches for a schedule of {self.schedule_microbatches}")
        state = _StepState()
        self.compute_s = 0.0
        self.action_s = {}
        for item in self.lowered.programs[self.pp_rank]:
            if isinstance(item, CommBatch):
                self._communicate(item, state)
                continue
            start = time.perf_counter()
            halves = item.halves()
            if len(halves) == 2 and self.fb_overlap is not None:
                self.fb_overlap(lambda: self._compute(halves[0], state, inputs),
                                lambda: self._compute(halves[1], state, inputs))
            else:
                for half in halves:
                    self._compute(half, state, inputs)
            spent = time.perf_counter() - start
            self.compute_s += spent
            self.action_s.setdefault(item.kind, []).append(spent)
            if self.after_compute is not None:
                self.after_compute(item)
        self._finish_sends(wait=True)
        problems = state.leftovers() + [f"live activations {sorted(state.live)}"] * bool(state.live)
        if problems:
            raise ScheduleError(f"pipeline rank {self.pp_rank}: step ended holding " + "; ".join(problems))
        self.store.assert_empty()
        self.peak_live = state.peak

    def _compute(self, action: Action, state: _StepState, inputs: Sequence[Any]) -> None:
        key = (action.stage, action.microbatch)
        if action.kind is ActionKind.F:
            self._forward(key, state, inputs[action.microbatch])
        elif action.kind is ActionKind.W:
            self.store.run_w(*key)
            state.live.discard(key)
        else:
            self._backward_action(action, state)

    def _forward(self, key: Key, state: _StepState, inputs: Any) -> None:
        stage, microbatch = key
        x = state.inputs.get(key) if stage > 0 else None
        if stage > 0 and x is None:
            raise ScheduleError(f"F{stage}.{microbatch}: its input has not arrived")
        state.inputs[key] = x
        output = self.stages[stage].forward(microbatch, x, inputs)
        state.outputs[key] = output
        state.live.add(key)
        state.peak = max(state.peak, len(state.live))
        if stage == self.num_stages - 1:
            return
        self._check_activation(key, output)
        if self._local(stage + 1, microbatch):
            state.inputs[(stage + 1, microbatch)] = output.detach().requires_grad_()
        elif output._base is not None:
            raise ScheduleError(f"F{stage}.{microbatch}: a sent output must not be a view (its storage is released)")

    def _check_activation(self, key: Key, output: torch.Tensor) -> None:
        if tuple(output.shape) != self.shape or output.dtype != self.dtype:
            raise ScheduleError(f"F{key[0]}.{key[1]}: output {tuple(output.shape)} {output.dtype}, "
                                f"activations must be {self.shape} {self.dtype}")

    def forward_only(self, inputs: Sequence[Any]) -> None:
        """Forwards of any number of micro-batches through every stage, nothing kept for a
        backward (run it under `torch.no_grad()`, e.g. for evaluation).

        No schedule: micro-batch after micro-batch, stage after stage, each stage where direction 0
        places it; an output goes to the next stage's rank by a blocking send. Every rank walks the
        same (micro-batch, stage) order, so each send meets its receive.
        """
        placement, last = self.lowered.schedule.placement, self.num_stages - 1
        mine = [s for s in placement.stages_on(self.pp_rank) if placement.rank_of(s) == self.pp_rank]
        for microbatch, item in enumerate(inputs):
            x: Optional[torch.Tensor] = None
            for stage in mine:
                if stage > 0 and placement.rank_of(stage - 1) != self.pp_rank:
                    x = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                    dist.recv(x, self._peer(placement.rank_of(stage - 1)), group=self.group)
                x = self.stages[stage].forward(microbatch, x, item)
                if stage == last:
                    continue
                self._check_activation((stage, microbatch), x)
                if placement.rank_of(stage + 1) != self.pp_rank:
                    dist.send(x, self._peer(placement.rank_of(stage + 1)), group=self.group)

    def _backward_action(self, action: Action, state: _StepState) -> None:
        stage, microbatch = key = (action.stage, action.microbatch)
        output = state.outputs.pop(key)
        if stage == self.num_stages - 1:
            grad = torch.ones_like(output)
        else:
            grad = state.output_grads.pop(key)
        with self.store.scope(stage, microbatch, action.kind):
            _backward(output, grad)
        if action.kind is ActionKind.BW:
            state.live.discard(key)
        x = state.inputs.pop(key)
        if stage == 0:
            return
        if x.grad is None:
            raise ScheduleError(f"{action}: the stage output does not depend on its input")
        if self._local(stage - 1, microbatch):
            state.output_grads[(stage - 1, microbatch)] = x.grad
        else:
            state.input_grads[key] = x.grad

    def _communicate(self, batch: CommBatch, state: _StepState) -> None:
        ops, arrivals = [], []
        for action in batch.ops:
            key = (action.stage, action.microbatch)
            peer = self._peer(action.peer)
            if action.kind is ActionKind.SEND_F:
                tensor = state.outputs[key]
            elif action.kind is ActionKind.SEND_B:
                tensor = state.input_grads.pop(key)
            else:
                tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                arrivals.append((action.kind, key, tensor))
            op = dist.isend if action.kind.is_send else dist.irecv
            ops.append(dist.P2POp(op, tensor, peer, self.group))
        works = dist.batch_isend_irecv(ops)
        per_op = len(works) == len(ops)
        if not per_op:
            for work in works:
                work.wait()
        for index, (action, op) in enumerate(zip(batch.ops, ops)):
            work = works[index] if per_op else None
            if action.kind.is_send:
                self.pending_p2p.append(_PendingSend(work, op.tensor, action.kind is ActionKind.SEND_F))
            elif work is not None:
                work.wait()
        for kind, key, tensor in arrivals:
            if kind is ActionKind.RECV_F:
                state.inputs[key] = tensor.requires_grad_()
            else:
                state.output_grads[key] = tensor
        self._finish_sends(wait=False)

    def _finish_sends(self, wait: bool) -> None:
        """Release the storage of sent activations whose send completed (all of them if `wait`)."""
        pending = []
        for send in self.pending_p2p:
            if send.work is not None:
                if wait:
                    send.work.wait()
                elif not send.work.is_completed():
                    pending.append(send)
                    continue
            if send.release:
                send.tensor.data = torch.empty((1,), dtype=send.tensor.dtype, device=send.tensor.device)
        self.pending_p2p = pending
