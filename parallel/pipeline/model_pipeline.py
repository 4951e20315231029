"""The DeepSeek-V3 model run through a pipeline schedule on one rank: what the trainer drives.

Builds the validated plan, cuts the model into stages, keeps this rank's model (its stages' parts), the W store,
the runtime and the replica sums together, and runs one step's micro-batches. Given the trainer's
`GradientSync`, a step also starts the data-parallel reduction of each bucket as soon as every
gradient in it is final (`grad_ready`); `buffer_layout` lays the buckets out in that order, and the
parameters another pipeline rank also holds (tied embedding, DualPipe mirrors) in buckets of their
own over their pair x dp, in the canonical order of `replicas` (without `sync`, they are only
summed over their pair, after the step).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from model.args import ModelArgs
from model.dispatcher import Dispatcher
from parallel.data_parallel import GradientSync
from parallel.dispatch.handles import OverlapSwitch
from parallel.mixed_precision import zero_grad_buffers
from parallel.topology import Topology, group_ranks

from .builders import build
from .grad_ready import GradientReadiness, release_positions, split_weights
from .ir import Action, LoweredSchedule
from .overlap import FBOverlap
from .replicas import PipelineReplicas
from .runtime import PipelineRuntime
from .stage import MicroBatch, StageSpec, build_stages, stage_specs
from .timeline import Costs
from .validate import validate
from .wgrad import WeightGradStore


def pipeline_plan(args: ModelArgs, pp: int, schedule: str, microbatches: int, virtual_stages: Optional[int] = None,
                  layout: Optional[str] = None, first_stage_layers: Optional[int] = None,
                  last_stage_layers: Optional[int] = None, costs: Optional[Costs] = None,
                  memory_limit: Optional[float] = None) -> tuple[LoweredSchedule, list[StageSpec]]:
    """The lowered schedule and the stage cut; ValueError names what does not fit. `costs` and
    `memory_limit` feed the cost-driven builders (zb-auto's search)."""
    lowered = validate(build(schedule, pp, microbatches, virtual_stages, costs, memory_limit), costs)
    specs = stage_specs(args, lowered.schedule.num_stages, layout, first_stage_layers, last_stage_layers)
    return lowered, specs


class ModelPipeline:
    """This rank's stages of the model and the runtime that runs them.

    `overlap`: FB actions run their halves interleaved (`parallel.pipeline.overlap`), passing the baton
    through this switch, the one `dispatcher` completes its collectives through (None: one half after
    the other). `fp8`: the weight GEMMs in FP8 (model.fp8; train.precision=fp8).
    The runtime is created at the first step, when the model has its final device and dtype.
    """

    def __init__(self, args: ModelArgs, topology: Topology, lowered: LoweredSchedule, specs: Sequence[StageSpec],
                 micro_batch_size: int, seq_length: int, dispatcher: Optional[Dispatcher] = None,
                 timeout_s: float = 300.0, overlap: Optional[OverlapSwitch] = None, fp8: bool = False) -> None:
        self.topology, self.lowered = topology, lowered
        placement = lowered.schedule.placement
        self.store = WeightGradStore()
        self.model, self.stages = build_stages(args, specs, placement.stages_on(topology.pp_rank), self.store,
                                               dispatcher, fp8)
        pipelines = group_ranks(topology.world_size, topology.pp, topology.ep, topology.gpus_per_node).pp
        self.replicas = PipelineReplicas(self.model, placement, topology.pp_rank, pipelines,
                                         tied_embedding=args.mtp_num_layers > 0, timeout_s=timeout_s,
                                         ep=topology.ep)
        self.shape = (micro_batch_size, seq_length, args.hidden_size)
        self.runtime: Optional[PipelineRuntime] = None
        self.overlap = overlap
        self._use(lowered)
        self._replicated = {id(p) for p in self.replicas.params}
        self._sync: Optional[GradientSync] = None

    def _use(self, lowered: LoweredSchedule) -> None:
        """Run `lowered` from the next step: when each gradient is final follows from its programs."""
        self.lowered, self.runtime = lowered, None
        stage_params = {s: stage.parameters() for s, stage in self.stages.items()}
        split = split_weights([self.model])
        self.readiness = GradientReadiness(lowered.programs[self.topology.pp_rank], stage_params, split)
        if self.replicas.mirror and self.replicas.pair is not None:  # both members hold the same stages
            self.replicas.order_by_release([release_positions(lowered.programs[r], stage_params, split)
                                            for r in self.replicas.pair])

    def buffer_layout(self) -> dict:
        """`parallel.data_parallel.build_buffers`'s arguments for this rank: parameters ordered by when
        their gradient becomes final in the current program, the replicated ones with their groups."""
        stage_params = {s: stage.parameters() for s, stage in self.stages.items()}
        position = release_positions(self.lowered.programs[self.topology.pp_rank], stage_params,
                                     split_weights([self.model]))
        return {"order": lambda param: position[id(param)], "replicated": self.replicas.params,
                "replica_groups": (self.replicas.dense_group, self.replicas.expert_group)}

    def switch_schedule(self, lowered: LoweredSchedule) -> None:
        """Another schedule over the same stages from the next step: zb-auto's after its measured warm-up, or
        the one for another number of micro-batches per step (a batch ramp)."""
        old = self.lowered.schedule
        if lowered.schedule.placement != old.placement:
            raise ValueError(f"switch_schedule: {lowered.schedule.name} places its stages unlike {old.name}")
        self._use(lowered)

    @property
    def num_microbatches(self) -> int:
        return self.lowered.schedule.num_microbatches

    def _runtime(self) -> PipelineRuntime:
        if self.runtime is None:
            param = next(self.model.parameters())
            self.runtime = PipelineRuntime(self.lowered, self.topology.pp_rank, self.stages, self.store,
                                           (self.shape, param.dtype, param.device), self.topology.group("pp"),
                                           after_compute=self._after_compute)
            if self.overlap is not None:
                self.runtime.fb_overlap = FBOverlap(self.overlap)
        return self.runtime

    def _after_compute(self, action: Action) -> None:
        ready = self.readiness.done(action)
        if not ready or self._sync is None:
            return
        self._sync.launch([p for p in ready if id(p) not in self._replicated])
        self._sync.launch(self.replicas.release(p for p in ready if id(p) in self._replicated))

    def step(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_scale: float,
             sync: Optional[GradientSync] = None, mtp_loss_scale: Optional[float] = None) -> torch.Tensor:
        """Forward and backward of every micro-batch (its loss times `loss_scale`), replicated gradients
        summed; with `sync`, gradients also reduced over data parallelism (complete on return),
        replicated ones summed and reduced by one collective. `mtp_loss_scale` None: the model's
        mtp_loss_scaling_factor.

        Returns this rank's sum over micro-batches of [lm_loss, mtp_loss, aux_loss] x loss_scale
        (lm and mtp from the loss stage, aux from this rank's MoE layers), float64 on the model's device.
        """
        runtime = self._runtime()
        self.readiness.start()
        self.replicas.start()
        self._sync = sync
        try:
            zero_grad_buffers(self.model.parameters())
            runtime.step([MicroBatch(ids, labels, loss_scale, mtp_loss_scale) for ids, labels in batches])
            self.readiness.assert_done()
            if sync is None:
                self.replicas.reduce_gradients()
            else:
                self.replicas.assert_released()
                sync.finish()
        finally:
            self._sync = None
        param = next(self.model.parameters())
        sums = torch.zeros(3, dtype=torch.float64, device=param.device)
        for stage in self.stages.values():
            for parts in stage.pop_parts().values():
                sums += parts * loss_scale
        return sums

    def evaluate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], counted: int) -> torch.Tensor:
        """Forward-only pass (no W store, no backward): this rank's sum of the lm losses of the
        first `counted` of `batches` (zero unless it holds the loss stage), float64 on the model's device."""
        with torch.no_grad():
            self._runtime().forward_only([MicroBatch(ids, labels) for ids, labels in batches])
        total = torch.zeros((), dtype=torch.float64, device=next(self.model.parameters()).device)
        for stage in self.stages.values():
            for microbatch, parts in stage.pop_parts().items():
                if microbatch < counted:
                    total += parts[0]
        return total

    def destroy(self) -> None:
        self.replicas.destroy()
