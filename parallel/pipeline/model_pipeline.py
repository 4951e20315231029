"""The DeepSeek-V3 model run through a pipeline schedule on one rank: what the trainer drives.

Builds the validated plan, cuts the model into stages, keeps this rank's `StageModel`, the W store,
the runtime and the replica sums together, and runs one step's micro-batches.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional, Sequence

import torch

from model.args import ModelArgs
from model.dispatcher import Dispatcher
from parallel.topology import Topology, group_ranks

from .ir import LoweredSchedule
from .plan import plan
from .replicas import PipelineReplicas
from .runtime import PipelineRuntime
from .stage import StageSpec, build_stages, stage_specs
from .wgrad import WeightGradStore, split_backward, zero_grad_buffers


def pipeline_plan(args: ModelArgs, pp: int, schedule: str, microbatches: int, virtual_stages: Optional[int] = None,
                  layout: Optional[str] = None, first_stage_layers: Optional[int] = None,
                  last_stage_layers: Optional[int] = None) -> tuple[LoweredSchedule, list[StageSpec]]:
    """The lowered schedule and the stage cut; ValueError names what does not fit."""
    lowered = plan(schedule, pp, microbatches, virtual_stages)
    specs = stage_specs(args, lowered.schedule.num_stages, layout, first_stage_layers, last_stage_layers)
    return lowered, specs


class ModelPipeline:
    """This rank's stages of the model and the runtime that runs them.

    `forward_context` wraps every stage forward (e.g. bf16 autocast); backwards run outside it.
    The runtime is created at the first step, when the model has its final device and dtype.
    """

    def __init__(self, args: ModelArgs, topology: Topology, lowered: LoweredSchedule, specs: Sequence[StageSpec],
                 micro_batch_size: int, seq_length: int, dispatcher: Optional[Dispatcher] = None,
                 timeout_s: float = 300.0,
                 forward_context: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        self.topology, self.lowered = topology, lowered
        placement = lowered.schedule.placement
        self.model, self.stages = build_stages(args, specs, placement.stages_on(topology.pp_rank), dispatcher)
        for stage in self.stages.values():
            stage.forward_context = forward_context
        pipelines = group_ranks(topology.world_size, topology.pp, topology.ep, topology.gpus_per_node).pp
        self.replicas = PipelineReplicas(self.model, placement, topology.pp_rank, pipelines,
                                         tied_embedding=args.mtp_num_layers > 0, timeout_s=timeout_s)
        self.store = WeightGradStore()
        self.shape = (micro_batch_size, seq_length, args.hidden_size)
        self.runtime: Optional[PipelineRuntime] = None

    @property
    def num_microbatches(self) -> int:
        return self.lowered.schedule.num_microbatches

    def step(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_scale: float) -> torch.Tensor:
        """Forward and backward of every micro-batch, replicated gradients summed.

        Returns this rank's sum over micro-batches of [lm_loss, mtp_loss, aux_loss] x loss_scale
        (lm and mtp from the loss stage, aux from this rank's MoE layers), float64 on the model's device.
        """
        param = next(self.model.parameters())
        if self.runtime is None:
            self.runtime = PipelineRuntime(self.lowered, self.topology.pp_rank, self.stages, self.store,
                                           (self.shape, param.dtype, param.device), self.topology.pp_group)
        with split_backward(self.store):
            zero_grad_buffers(self.model.parameters())
            self.runtime.step(batches, loss_scale)
        self.replicas.reduce_gradients()
        sums = torch.zeros(3, dtype=torch.float64, device=param.device)
        for stage in self.stages.values():
            for parts in stage.pop_parts().values():
                sums += parts * loss_scale
        return sums

    def destroy(self) -> None:
        self.replicas.destroy()
