"""The training loop: `python -m moe_train.train --config FILE [--set section.key=value ...]`.

One process, or data x expert parallel, or pipeline parallel on top (pp > 1: every step runs
through `parallel.pipeline`'s runtime with the configured schedule, built for the step's number of
micro-batches). In every layout losses are averaged over the step's global batch, the data order depends
only on the seed, and the router bias update uses expert loads of the whole global batch. A step's global
batch follows the samples consumed before it (`train.rampup_batch_size`, moe_train.batch_ramp), and so do
the learning rate and the other schedules; training ends when `train.steps` x `train.global_batch_size`
samples are consumed.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from model.flops import training_flops_per_token
from model.fp8 import Fp8GemmOps, fp8_gemm_backend
from model.init import initialize_parameters
from model.transformer import DeepSeekV3
from moe_train.batch_ramp import batch_ramp
from moe_train.checkpoint.dcp import (BackgroundSaves, CheckpointError, holds_ema, is_hf_folder, iteration_dir,
                                      latest_iteration, load_checkpoint, read_metadata, resolve_resume,
                                      save_checkpoint, saved_moment_dtypes)
from moe_train.config import Config, ConfigError, load_config, to_dict, to_yaml
from moe_train.config.help import config_keys_help
from moe_train.data import (BatchSampler, DataError, SampleStream, build_datasets, build_demo_corpus, check_vocab,
                            describe_draws, load_tokenizer)
from moe_train.checkpoint.hf_checkpoint import check_model_section, load_hf_weights
from moe_train.moe_metrics import MOE_LAYERS, MoELayerMetrics
from moe_train.memory_snapshot import MemorySnapshot, memory_snapshot_problem
from moe_train.metrics import LogWriteError, MetricsLogger, format_duration, peak_memory
from moe_train.profiling import StepProfiler
from moe_train.straggler import ComputeClock, RankTimesExchange, find_stragglers, rank_metrics, straggler_line
from moe_train.ema import ParameterEMA
from moe_train.optim import build_optimizer, set_learning_rate
from moe_train.launch.exit_codes import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_PEER_FAILED, EXIT_WRITE_FAILED
from moe_train.preflight.pipeline import plan_pipeline
from moe_train.preflight.start_up import choose_dispatcher, refuse_at_start_up, start_distributed
from moe_train.launch.run_dir import RunDirError, RunLock, claim_run_dir
from moe_train.zb_measure import WARMUP_SCHEDULE, ZbCostMeter, measures_zb_costs
from moe_train.runtime import compile_model, configure_threads, seed_everything, select_device
from moe_train.schedules import bias_update_rate, learning_rate, mtp_loss_scale
from moe_train.launch.stop import StopRequest
from moe_train.launch.stop_signals import ignore_stop_signals
from parallel.adamw import MOMENT_DTYPES
from parallel.data_parallel import GradientSync, build_buffers
from parallel.dispatch import DispatcherUnavailable, OverlapSwitch, make_dispatcher
from parallel.failures import collective_failure
from parallel.mixed_precision import PARAM_DTYPES, accumulate_weight_grad, release_grads
from parallel.pipeline.ir import LoweredSchedule
from parallel.pipeline.timeline import Costs, simulate
from parallel.pipeline.model_pipeline import ModelPipeline
from parallel.sharded_state import piece_state
from parallel.topology import Topology, routing_statement

LOSS_PARTS = ("lm_loss", "mtp_loss", "aux_loss")


class TrainingDiverged(RuntimeError):
    pass


def default_cache_dir() -> str:
    return os.environ.get("MOE_TRAIN_CACHE", str(Path.home() / ".cache" / "moe_train"))


def read_metrics(steps: list[dict[str, torch.Tensor | float]]) -> list[dict[str, Any]]:
    """Step metrics with their tensors read back to the host: one copy, one host sync for all steps; a tensor
    of several values (the MoE layer table) comes back as a flat list."""
    tensors = [v for m in steps for v in m.values() if isinstance(v, torch.Tensor)]
    values = iter(torch.cat([t.double().reshape(-1) for t in tensors]).tolist() if tensors else [])

    def read(t: torch.Tensor) -> float | list[float]:
        return next(values) if t.dim() == 0 else [next(values) for _ in range(t.numel())]

    return [{k: read(v) if isinstance(v, torch.Tensor) else v for k, v in m.items()} for m in steps]


def non_finite_part(record: dict[str, float]) -> str | None:
    """The first non-finite part of a step's record, as a message names it (lm, mtp, aux, gradient), or None."""
    for part, key in (("lm", "lm_loss"), ("mtp", "mtp_loss"), ("aux", "aux_loss"), ("gradient", "grad_norm")):
        if not math.isfinite(record[key]):
            return f"{part} {'norm' if part == 'gradient' else 'loss'} ({record[key]})"
    return None


class Trainer:
    def __init__(self, config: Config, topology: Topology | None = None, stop: StopRequest | None = None) -> None:
        self.cfg = config
        self.topology = topology
        self.stop = stop if stop is not None else StopRequest()  # main's handles the signals; a new one is never signalled
        dispatcher_name = choose_dispatcher(config, topology)  # before any work: a backend that cannot run fails now
        self.is_logger = topology is None or topology.rank == 0
        configure_threads(config.train)
        seed_everything(config.train.seed)
        self.device = select_device(config.train)
        self.run_dir = Path(config.logging.dir)
        self.memory_snapshot = self._start_memory_snapshot()  # before the model is built: its history from here
        self.ramp = batch_ramp(config.train)
        self.end_samples = config.train.steps * config.train.global_batch_size  # train.steps counts final batches
        self.tokenizer = load_tokenizer(config.data.tokenizer)
        self.train_data, self.valid_data = self._build_data()
        switch = OverlapSwitch()  # the overlapped pairs pass the baton where the dispatcher's collectives complete
        self.compute_clock = ComputeClock(switch)
        dispatcher = make_dispatcher(dispatcher_name, topology, config.model.num_moe_experts,
                                     fp8=config.parallel.fp8_dispatch, comm_sms=config.parallel.comm_sms,
                                     device=self.device.type, switch=switch)
        self.pipeline: ModelPipeline | None = None
        fp8 = config.train.precision == "fp8"  # FP8 weight GEMMs (model.fp8) over bf16 parameters
        self.zb_meter: ZbCostMeter | None = None
        self.zb_costs: Costs | None = None  # zb-auto's measured costs, once measured
        self.schedules: dict[int, LoweredSchedule] = {}  # by a step's global batch, lowered on first use
        if topology is not None and topology.pp > 1:
            lowered, specs = plan_pipeline(config, topology.dp)
            self.schedules[config.train.global_batch_size] = lowered
            self.pipeline = ModelPipeline(config.model, topology, lowered, specs, config.train.micro_batch_size,
                                          config.train.seq_length, dispatcher, config.parallel.timeout_s,
                                          overlap=switch if config.parallel.overlap else None, fp8=fp8)
            self.model = self.pipeline.model
            if measures_zb_costs(config.parallel):
                self.zb_meter = ZbCostMeter(config.parallel.zb_measure_steps)
        else:
            self.model = DeepSeekV3(config.model, dispatcher, Fp8GemmOps(sink=accumulate_weight_grad) if fp8 else None)
        self.moe_metrics = MoELayerMetrics(self.model, config.model, self.device)
        initialize_parameters(self.model, config.train.seed, config.model.init_method_std)
        self.model.to(self.device)
        # the parameters in data-parallel buckets, in the compute dtype (bf16: parallel.mixed_precision)
        buffers = build_buffers(self.model, topology, PARAM_DTYPES[config.train.precision], config.parallel.zero1,
                                config.parallel.grad_bucket_elements,
                                **({} if self.pipeline is None else self.pipeline.buffer_layout()))
        self.optimizer = build_optimizer(self.model, buffers, config.optim)
        self.compiled = compile_model(self.model, config.train.compile, config.train.precision)
        self.ema = None if config.optim.ema_decay is None else ParameterEMA(
            self.optimizer.master_weights(), config.optim.ema_decay)
        self.grads = GradientSync(buffers, topology)
        dp_size, dp_rank = (1, 0) if topology is None else (topology.dp, topology.dp_rank)
        self.sampler = BatchSampler(self.train_data, config.train.global_batch_size, config.train.micro_batch_size,
                                    dp_size, dp_rank)
        self.step = 0
        self.consecutive_skips = 0
        self.skipped_since_log = 0
        self._resume()
        self.background_saves = BackgroundSaves(None if topology is None else dist.group.WORLD) \
            if config.checkpoint.async_save else None
        log = config.logging
        wandb = None if log.wandb_project is None else {
            "project": log.wandb_project, "mode": log.wandb_mode, "name": self.run_dir.name, "config": to_dict(config)}
        self.total_steps = self.step + self.ramp.walk(self.sampler.consumed_samples, self.end_samples)[0]
        self.logger = MetricsLogger(self.run_dir, self.total_steps, enabled=self.is_logger,
                                    tensorboard=log.tensorboard, resume_step=self.step, wandb=wandb)
        self.profiler = StepProfiler(log.profile_steps, log.profile_ranks, 0 if topology is None else topology.rank,
                                     self.run_dir, self.device)
        self.rank_times = None if topology is None or log.straggler_threshold is None else \
            RankTimesExchange(topology.pp_rank, self.device)  # one process: no exchange, no report
        if self.is_logger:
            path = self.run_dir / "config.yaml"
            try:
                path.write_text(to_yaml(config))
            except OSError as err:
                raise LogWriteError(f"cannot write {path}: {err.strerror}") from err
        if config.train.compile != "none":
            self.logger.info(f"torch.compile: {self.compiled}")
        if fp8:
            self.logger.info("train.precision=fp8: " + fp8_gemm_backend(self.device))
        self.flops_per_token = training_flops_per_token(config.model, config.train.seq_length,
                                                        with_mtp=config.model.mtp_num_layers > 0)

    def _start_memory_snapshot(self) -> MemorySnapshot | None:
        """`logging.memory_snapshot` on this rank (one of `logging.profile_ranks`): recording from now."""
        log, rank = self.cfg.logging, 0 if self.topology is None else self.topology.rank
        if not log.memory_snapshot or rank not in log.profile_ranks:
            return None
        problem = memory_snapshot_problem(self.device.type)  # (main refuses it at start-up already)
        if problem is not None:
            raise ConfigError([("logging.memory_snapshot", problem)])
        return MemorySnapshot(self.run_dir, rank)

    def _build_data(self) -> tuple[SampleStream, SampleStream | None]:
        """The train and valid streams, their tokens checked against the vocabulary; the logging rank says how
        many samples the run draws from each dataset."""
        d, t = self.cfg.data, self.cfg.train
        path = d.path or [build_demo_corpus(d.cache_dir or default_cache_dir(), self.tokenizer,
                                            max_bytes=d.demo_max_bytes, show_progress=True)]
        train, valid = build_datasets(path, t.seq_length, t.seed, d.split_fraction, eod_id=self.tokenizer.eod_id,
                                      valid_path=d.valid_path)
        for part in train.parts + (valid.parts if valid is not None else []):
            check_vocab(part.dataset, self.cfg.model.vocab_size)
        if self.is_logger:
            lines = describe_draws(train, self.ramp.walk(0, self.end_samples)[1], "train")
            if valid is not None and t.eval_interval:
                lines += describe_draws(valid, t.eval_iters * t.micro_batch_size, "valid")
            print("\n".join(lines), flush=True)
        return train, valid

    def _resume(self) -> None:
        """Load `checkpoint.resume`. The EMA (started from the initial weights) is loaded with the rest, or,
        where the checkpoint holds none or checkpoint.weights_only is set, restarted from the loaded weights."""
        ckpt = self.cfg.checkpoint
        path = resolve_resume(ckpt.resume, self.cfg.checkpoint_dir)
        if path is None:
            return
        if is_hf_folder(path):
            self._start_from_hf(path)
            ema = None
        else:
            ema = self._load(path)
        if self.ema is not None and ema is None:
            self.ema.restart()
            if self.is_logger:
                why = "checkpoint.weights_only" if ckpt.weights_only else "the checkpoint holds none"
                print(f"optim.ema_decay: no EMA loaded from {path} ({why}); the EMA starts from its weights",
                      flush=True)

    def _load(self, path: Path) -> dict[str, torch.Tensor] | None:
        """Load a checkpoint of ours; returns the EMA tensors it filled, or None."""
        ckpt = self.cfg.checkpoint
        ema = self.ema_state() if not ckpt.weights_only and holds_ema(read_metadata(path)) else None
        extra = load_checkpoint(path, self.model, None if ckpt.weights_only else self.optimizer,
                                weights_only=ckpt.weights_only, partial=self.pipeline is not None, ema=ema)
        if not ckpt.weights_only:
            self.step = extra["step"]
            self.sampler.load_state_dict(extra["data"])
        if self.is_logger:
            print(f"resumed from {path} at step {self.step}", flush=True)
            if not ckpt.weights_only:
                self._note_moment_conversion(path)
        return ema

    def ema_state(self) -> dict[str, torch.Tensor] | None:
        """This rank's EMA tensors keyed as the checkpoint holds them (experts split per expert), or None."""
        return None if self.ema is None else piece_state(self.model, self.optimizer.pieces, self.ema.average)

    def _note_moment_conversion(self, path: Path) -> None:
        """One line when the checkpoint's Adam moments have another dtype than `optim.moment_dtype`: loading
        converted them (fp32 to bf16 rounds to nearest even, bf16 to fp32 is exact)."""
        wanted = self.cfg.optim.moment_dtype
        saved = sorted(name for name, dtype in MOMENT_DTYPES.items() if dtype in saved_moment_dtypes(path))
        if saved and saved != [wanted]:
            print(f"resume: Adam moments converted from {', '.join(saved)} (the checkpoint's) to {wanted} "
                  "(optim.moment_dtype)", flush=True)

    def _start_from_hf(self, path: Path) -> None:
        """The weights of a Hugging Face folder, each rank reading only its own (moe_train.checkpoint.hf_checkpoint)."""
        if not self.cfg.checkpoint.weights_only:
            raise CheckpointError(f"checkpoint.resume: {path} is a Hugging Face folder (weights only); "
                                  "set checkpoint.weights_only=true to start training from it")
        check_model_section(self.cfg.model, path)
        load_hf_weights(path, self.model, None if self.topology is None else dist.group.WORLD)
        if self.is_logger:
            print(f"started from the Hugging Face weights in {path}", flush=True)

    def kept_checkpoint(self) -> str:
        step = latest_iteration(self.cfg.checkpoint_dir)
        if step is None:
            return "no checkpoint was written"
        return f"the last good checkpoint is kept: {iteration_dir(self.cfg.checkpoint_dir, step)}"

    def state_is_finite(self) -> bool:
        """Whether every weight, buffer, fp32 main parameter, optimizer state and EMA tensor of the whole
        job is finite: one all-reduce and one host read, made before each save."""
        tensors = [*self.model.parameters(), *self.model.buffers(),
                   *self.optimizer.master_weights().values(),
                   *(v for state in self.optimizer.state.values() for v in state.values()
                     if isinstance(v, torch.Tensor) and v.is_floating_point())]
        finite = torch.stack([t.isfinite().all() for t in tensors]).all()
        if self.ema is not None:
            finite = finite & self.ema.finite().to(finite.device)
        finite = finite.float()
        if self.topology is not None:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return bool(finite.item())

    def save(self, wait: bool = False) -> Path:
        """Write a checkpoint of the current step, the EMA after its last update included; TrainingDiverged
        instead when the state is not finite. With checkpoint.async_save the write goes on in the background
        (published at a later step boundary, `wait`: before returning)."""
        if self.ema is not None:
            self.ema.wait()
        if self.background_saves is not None:
            self.background_saves.wait()  # the previous save counts before this state is checked
        if not self.state_is_finite():
            raise TrainingDiverged(f"step {self.step}: non-finite weights, optimizer state or EMA, not saving them; "
                                   f"{self.kept_checkpoint()}")
        extra = {"step": self.step, "data": self.sampler.state_dict(),
                 "consumed_samples": self.sampler.consumed_samples}
        text_files = {"config.yaml": to_yaml(self.cfg)}
        if self.background_saves is None:
            return save_checkpoint(self.cfg.checkpoint_dir, self.step, self.model, self.optimizer, extra,
                                   keep=self.cfg.checkpoint.keep, text_files=text_files,
                                   process_group=None if self.topology is None else dist.group.WORLD,
                                   ema=self.ema_state())
        path = self.background_saves.start(self.cfg.checkpoint_dir, self.step, self.model, self.optimizer, extra,
                                           keep=self.cfg.checkpoint.keep, text_files=text_files, ema=self.ema_state())
        if wait:
            self.background_saves.wait()
        return path

    def _inputs(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch's token rows on the device as (input ids, labels): the ids shifted by one."""
        rows = rows.to(self.device, non_blocking=True)
        return rows[:, :-1], rows[:, 1:]

    def _forward_backward(self, micro_batches: list[torch.Tensor], mtp_scale: float) -> dict[str, torch.Tensor]:
        """Backward of this rank's mean loss; returns the global-batch mean of each loss part (on the device)."""
        if self.pipeline is not None:
            return self._pipeline_forward_backward(micro_batches, mtp_scale)
        parts = ("loss", *LOSS_PARTS)
        sums = torch.zeros(len(parts), dtype=torch.float64, device=self.device)
        scale = 1.0 / len(micro_batches)
        with self.compute_clock.phase():
            for ids, labels in map(self._inputs, micro_batches):
                out = self.model(ids, labels, mtp_loss_scale=mtp_scale, aux_grad_scale=scale)
                (out.loss * scale).backward()
                sums += torch.stack([getattr(out, part).detach().double() for part in parts]) * scale
        dp = 1 if self.topology is None else self.topology.dp
        reduced = self.grads.sum_over_dp(self.stop.with_vote(sums))  # pp 1: dp spans every rank
        self.stop.count(reduced[-1])
        return dict(zip(parts, (reduced[:-1] / dp).unbind()))

    def _pipeline_forward_backward(self, micro_batches: list[torch.Tensor],
                                   mtp_scale: float) -> dict[str, torch.Tensor]:
        """The same through the pipeline runtime; loss parts come from the stages that compute them."""
        assert self.pipeline is not None and self.topology is not None
        lowered = self._schedule(self.batch_size())
        if lowered is not self.pipeline.lowered:
            self.pipeline.switch_schedule(lowered)
        scale = 1.0 / len(micro_batches)
        batches = [self._inputs(rows) for rows in micro_batches]
        with self.compute_clock.phase(busy_s=lambda: self.pipeline.runtime.compute_s):  # its compute actions
            sums = self.pipeline.step(batches, scale, sync=self.grads, mtp_loss_scale=mtp_scale)
        sums = self.stop.with_vote(sums)
        if self.zb_meter is not None:
            self._measure_zb_costs(self.zb_meter)
        dist.all_reduce(sums)  # over pp and dp: each part of each micro-batch once per dp replica, each rank's vote
        self.stop.count(sums[-1])
        lm_loss, mtp_loss, aux_loss = (sums[:-1] / self.topology.dp).unbind()
        return {"loss": lm_loss + mtp_scale * mtp_loss + aux_loss, "lm_loss": lm_loss, "mtp_loss": mtp_loss,
                "aux_loss": aux_loss}

    def _schedule(self, global_batch: int) -> LoweredSchedule:
        """The pipeline schedule of a step of `global_batch` samples (its micro-batch count), lowered once."""
        assert self.topology is not None
        if global_batch not in self.schedules:
            self.schedules[global_batch] = plan_pipeline(self.cfg, self.topology.dp, self.zb_costs, global_batch)[0]
        return self.schedules[global_batch]

    def _measure_zb_costs(self, meter: ZbCostMeter) -> None:
        """After a warm-up step: its times; after the last, zb-auto's schedules from the slowest rank's costs
        (this step's micro-batch count's now, each other count's when a step first uses it)."""
        assert self.pipeline is not None and self.pipeline.runtime is not None and self.topology is not None
        meter.record(self.pipeline.runtime)
        if not meter.done:
            return
        self.zb_meter = None
        measured = meter.measured(self.device)
        self.zb_costs = measured.costs
        self.schedules.clear()
        lowered = self._schedule(self.batch_size())
        warmup, chosen = (simulate(s, measured.costs) for s in (self.pipeline.lowered.schedule, lowered.schedule))
        self.pipeline.switch_schedule(lowered)
        f, b, w = (1e3 * t for t in measured.seconds)
        self.logger.info(f"zb-auto: costs per micro-batch measured over {meter.steps - 1} steps of {WARMUP_SCHEDULE} "
                         f"(slowest stage): F {f:.2f} ms, B {b:.2f} ms, W {w:.2f} ms; predicted bubble "
                         f"{warmup.bubble:.2f} -> {chosen.bubble:.2f} F, step {warmup.makespan:.2f} -> "
                         f"{chosen.makespan:.2f} F ({WARMUP_SCHEDULE} -> zb-auto) from step {self.step + 1}")

    def _update_router_biases(self, rate: float, keep: torch.Tensor) -> torch.Tensor:
        """Bias update from the global batch's expert loads, times `keep` (0 on a skipped step);
        returns the per-MoE-layer table of the whole model (moe_train.moe_metrics), the same on every rank."""
        routers = self.model.routers()
        loads = biases = torch.zeros(0, 0, device=self.device)
        if routers:
            loads = self.grads.sum_over_dp(torch.stack([r.expert_load for r in routers]))
            if self.pipeline is not None:
                self.pipeline.replicas.sum_loads(loads)
            for router, load in zip(routers, loads):
                router.apply_bias_update(load, keep * rate)
                router.expert_load.zero_()
            biases = torch.stack([r.e_score_correction_bias for r in routers])
        table = self.moe_metrics.table(loads, biases)
        if self.pipeline is not None:
            dist.all_reduce(table, op=dist.ReduceOp.MAX)
        return table

    def batch_size(self) -> int:
        """The global batch of the step about to run: train.rampup_batch_size at the samples consumed so far."""
        return self.ramp.batch_size(self.sampler.consumed_samples)

    def progress(self) -> float:
        """Where the step about to run stands in the schedules (moe_train.schedules): the samples consumed
        before it over train.global_batch_size, its 0-based index at a constant batch."""
        return self.sampler.consumed_samples / self.cfg.train.global_batch_size

    def has_next_step(self) -> bool:
        """Whether the next step's whole batch fits in the samples to train (train.steps x global batch)."""
        return self.sampler.consumed_samples + self.batch_size() <= self.end_samples

    def compute_gradients(self, micro_batches: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Forward and backward of the next global batch (batch_size), or of this rank's `micro_batches` when
        given (benchmarks.fp8_gradient_error: one batch on two trainers), gradients reduced over data
        parallelism (by the pipeline as their gradients become final, else here afterwards). The weights are fixed
        meanwhile, so FP8 GEMMs quantize each once for every micro-batch (model.fp8). The batch counts as
        consumed once apply_update has stepped."""
        with self.model.gemms.weights_fixed():
            if micro_batches is None:
                micro_batches = self.sampler.microbatches(self.batch_size())
            losses = self._forward_backward(micro_batches, mtp_loss_scale(self.progress(), self.cfg.optim,
                                                                          self.cfg.model))
        if self.pipeline is None:
            self.grads.finish()
        return losses

    def apply_update(self) -> dict[str, torch.Tensor]:
        """Clip, optimizer step, EMA update (moe_train.ema), router-bias update; advances the step counter
        and the consumed samples past the step's batch.

        A step whose global gradient norm is not finite is skipped on the device (every rank sees the
        same norm): the fused AdamW gets it as `found_inf` and leaves weights, moments and step
        counts alone, and the bias update is multiplied by 0. `skipped` is counted when read back.
        """
        cfg = self.cfg
        grad_norm = self.grads.clip(cfg.optim.clip_grad)
        skipped = (~grad_norm.isfinite()).float()
        self.optimizer.found_inf = skipped
        self.optimizer.step()
        if self.ema is not None:
            self.ema.update()
        release_grads(self.model.parameters())
        table = self._update_router_biases(bias_update_rate(self.progress(), cfg.optim, cfg.model), 1.0 - skipped)
        load_ratio = table[:, 0].max() if len(table) else torch.ones((), device=self.device)
        self.sampler.advance(self.batch_size())
        self.step += 1
        return {"grad_norm": grad_norm, "expert_load_max_over_mean": load_ratio, "skipped": skipped,
                MOE_LAYERS: table}

    def train_step(self) -> dict[str, torch.Tensor | float]:
        """One optimizer step. Its metrics stay on the device (`read_metrics` brings them to the host),
        so a step makes no host sync beyond the MoE layers' all-to-all split sizes."""
        cfg = self.cfg
        batch = self.batch_size()
        lr = learning_rate(self.progress(), cfg.optim, cfg.train.steps, batch / cfg.train.global_batch_size)
        set_learning_rate(self.optimizer, lr)
        losses = self.compute_gradients()
        update = self.apply_update()
        return {"step": self.step, **losses, "lr": lr, "global_batch_size": batch, **update}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean lm loss over `train.eval_iters` validation micro-batches (the same on every layout)."""
        self.model.eval()
        try:
            if self.pipeline is not None:
                return self._pipeline_evaluate()
            mbs, total = self.cfg.train.micro_batch_size, torch.zeros((), device=self.device)
            for i in range(self.cfg.train.eval_iters):
                total += self.model(*self._inputs(self.valid_data.rows(i * mbs, mbs))).lm_loss
            return total.item() / self.cfg.train.eval_iters
        finally:
            self.model.train()

    def _pipeline_evaluate(self) -> float:
        """The same through the pipeline, forward only: the validation micro-batches are dealt
        round-robin over dp; a replica short of one repeats micro-batch 0 uncounted, so every EP
        peer runs the same number of forwards. Every rank returns the global mean."""
        assert self.pipeline is not None and self.topology is not None
        mbs, iters, dp = self.cfg.train.micro_batch_size, self.cfg.train.eval_iters, self.topology.dp
        mine = range(self.topology.dp_rank, -(-iters // dp) * dp, dp)
        batches = [self._inputs(self.valid_data.rows((i if i < iters else 0) * mbs, mbs)) for i in mine]
        total = self.pipeline.evaluate(batches, counted=sum(i < iters for i in mine))
        dist.all_reduce(total)
        return total.item() / iters

    def train(self) -> int:
        """Train `train.steps` x `train.global_batch_size` samples (`train.steps` steps without a batch ramp), or
        to the step after which the ranks agree to stop (`moe_train.launch.stop`): either way every rank saves
        the same step. Returns the exit status."""
        cfg = self.cfg
        self.model.train()
        ramp = self.ramp.describe()
        self.logger.info(f"training {self.total_steps} steps from step {self.step} on {self.device} "
                         f"({cfg.train.precision}); logs in {self.run_dir}"
                         + (f"; {ramp}, {self.end_samples:,} samples in all" if ramp else ""))
        exchange = self.grads.buffers.bytes_per_step()
        if exchange:
            sent = ", ".join(f"{kind.replace('_', '-')} {size / 2 ** 20:.2f} MiB" for kind, size in exchange.items())
            self.logger.info(f"data-parallel exchange: {len(self.grads.buffers.buckets)} buckets; rank 0 sends {sent} "
                             f"per step ({sum(exchange.values()) / 2 ** 20:.2f} MiB)")
        step_times: list[float] = []
        step_samples: list[int] = []
        pending: list[dict[str, torch.Tensor | float]] = []
        start = time.perf_counter()
        try:
            while self.has_next_step():
                with self.profiler.step(self.step + 1):
                    pending.append(self.train_step())
                if self.memory_snapshot is not None and (written := self.memory_snapshot.after_step(self.step)):
                    print(f"memory snapshot through step {self.step} written to {written} "
                          "(pytorch.org/memory_viz)", flush=True)
                votes = self.stop.agreed()
                if self.background_saves is not None:
                    self.background_saves.poll()  # a failed background write stops the run here
                stop = votes > 0
                evaluate = bool(cfg.train.eval_interval and self.valid_data is not None
                                and self.step % cfg.train.eval_interval == 0)
                log = evaluate or self.step % cfg.train.log_interval == 0 or not self.has_next_step()
                save = bool(cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0)
                if not (log or save or stop):
                    continue  # the metrics stay on the device until the next log, checkpoint or stop
                records = read_metrics(pending)
                pending = []
                self._count_skips(records)
                elapsed = time.perf_counter() - start
                step_times += [elapsed / len(records)] * len(records)
                step_samples += [record["global_batch_size"] for record in records]
                if log:
                    tokens = sum(record["global_batch_size"] for record in records) * cfg.train.seq_length
                    self._log({**records[-1], "tokens_per_s": tokens / elapsed}, step_times, step_samples, evaluate)
                if save or stop:
                    path = self.save(wait=stop)
                start = time.perf_counter()
                if stop:
                    world = 1 if self.topology is None else self.topology.world_size
                    self.logger.info(f"{self.stop.reason(votes, world)}: saved {path}, exiting")
                    return 0
            if not cfg.checkpoint.interval or self.step % cfg.checkpoint.interval:
                self.save()
            if self.background_saves is not None:
                self.background_saves.wait()
        except TrainingDiverged as err:
            self.logger.info(f"error: {err}")
            return EXIT_DIVERGED
        except (CheckpointError, LogWriteError) as err:  # the previous checkpoint stays the latest
            if self.is_logger:  # every rank has the checkpoint error, rank 0 with every rank's part
                print(f"error: {err}", file=sys.stderr, flush=True)
            return EXIT_WRITE_FAILED
        except RuntimeError as err:
            line = collective_failure_line(err, self.topology, f"in step {self.step + 1}")
            if line is None:
                raise
            print(f"{line}; {self.kept_checkpoint()}", file=sys.stderr, flush=True)
            return EXIT_PEER_FAILED
        finally:
            if self.ema is not None:
                self.ema.close()
            if self.background_saves is not None:
                self.background_saves.close()
            self.logger.close()
        self.logger.info(f"done: {self.step} steps in {format_duration(sum(step_times))}")
        return 0

    def _count_skips(self, records: list[dict[str, float]]) -> None:
        """Report each skipped step; TrainingDiverged after `train.max_skipped_steps` in a row."""
        limit = self.cfg.train.max_skipped_steps
        for record in records:
            if not record.pop("skipped"):
                self.consecutive_skips = 0
                continue
            self.consecutive_skips += 1
            self.skipped_since_log += 1
            why = f"step {record['step']}: non-finite {non_finite_part(record)}"
            if self.consecutive_skips >= limit:
                raise TrainingDiverged(f"{why}; {self.consecutive_skips} consecutive steps skipped "
                                       f"(train.max_skipped_steps={limit}), stopping; {self.kept_checkpoint()}")
            self.logger.info(f"{why}: step skipped, no update ({self.consecutive_skips} in a row, "
                             f"train.max_skipped_steps={limit})")

    def _log(self, metrics: dict[str, Any], step_times: list[float], step_samples: list[int], evaluate: bool) -> None:
        """Log one step's record; tokens/s are those of the steps since the previous read-back,
        `skipped_steps` the steps skipped since the previous record (Megatron's skipped iterations), the ETA
        the samples left at the last 20 steps' samples per second."""
        cfg = self.cfg
        left = self.end_samples - self.sampler.consumed_samples
        record = {k: v for k, v in metrics.items() if k != MOE_LAYERS}
        record.update(self.moe_metrics.record(metrics[MOE_LAYERS]))
        record.update({"consumed_samples": self.sampler.consumed_samples, "skipped_steps": self.skipped_since_log,
                       "eta_s": left * sum(step_times[-20:]) / sum(step_samples[-20:])})
        self.skipped_since_log = 0
        if self.device.type == "cuda":
            record["mfu"] = metrics["tokens_per_s"] * self.flops_per_token / (cfg.train.peak_tflops * 1e12)
        record.update(peak_memory(self.device))
        if evaluate:
            record["valid_loss"] = self.evaluate()
        stragglers = self._exchange_rank_times(record, step_times)
        self.logger.log(record)
        for line in stragglers:
            self.logger.info(line)

    def _exchange_rank_times(self, record: dict[str, Any], step_times: list[float]) -> list[str]:
        """With several processes (collective): every rank's step and compute times since the previous log
        into `record`; returns the lines naming the stragglers (moe_train.straggler)."""
        compute_s, steps = self.compute_clock.take()
        if self.rank_times is None or not steps:
            return []
        times = self.rank_times.exchange(sum(step_times[-steps:]) / steps, compute_s / steps)
        record.update(rank_metrics(times))
        threshold = self.cfg.logging.straggler_threshold
        return [straggler_line(s, self.step, threshold) for s in find_stragglers(times, threshold)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moe-train", description="Train a DeepSeek-V3-like MoE model.",
                                     epilog=config_keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (see moe_train/configs/); required unless --print-config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value; repeatable")
    parser.add_argument("--print-config", nargs="?", const="", default=None, metavar="CONFIG",
                        help="print the resolved config (CONFIG or --config, else the defaults, with the --set "
                             "overrides) as YAML and exit")
    args = parser.parse_args(argv)
    if args.print_config is None and args.config is None:
        parser.error("the following arguments are required: --config")
    return args


def print_config(args: argparse.Namespace) -> int:
    """`--print-config`: the resolved YAML on stdout (exit 0), or the config's problems (exit 2)."""
    try:
        config = load_config(args.print_config or args.config, args.overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(to_yaml(config), end="")
    return 0


def claim_on_rank_0(config: Config, topology: Topology | None) -> RunLock | None:
    """Rank 0 claims `logging.dir` (see moe_train.launch.run_dir); every rank gets its outcome, so all stop together."""
    lock, error = None, None
    if topology is None or topology.rank == 0:
        try:
            lock = claim_run_dir(config)
        except RunDirError as err:
            error = str(err)
    if topology is not None:
        outcome = [error]
        dist.broadcast_object_list(outcome, src=0)
        error = outcome[0]
    if error is not None:
        raise RunDirError(error)
    return lock


def collective_failure_line(err: RuntimeError, topology: Topology | None, when: str) -> str | None:
    """The one line a rank prints when `err` is a failed collective (parallel.failures), else None."""
    reason = collective_failure(err)
    if reason is None:
        return None
    rank = 0 if topology is None else topology.rank
    return f"error: rank {rank}: a collective failed {when} ({reason}): a peer process died or the network broke"


def main(argv: list[str] | None = None, stop: StopRequest | None = None) -> int:
    """Exit status of one training run. Stop signals (`moe_train.launch.stop`) are noted by `stop` when given
    (its handlers installed), else by handlers installed for this call."""
    args = parse_args(argv)
    if args.print_config is not None:
        return print_config(args)
    if stop is not None:
        return run(args, stop)
    with StopRequest().handling_signals() as stop:
        return run(args, stop)


def run(args: argparse.Namespace, stop: StopRequest) -> int:
    topology, lock = None, None
    try:
        config = load_config(args.config, args.overrides)
        topology = start_distributed(config)
        if topology is not None and topology.rank == 0:
            print(f"layout: {topology.world_size} processes = pp {topology.pp} x dp {topology.dp} "
                  f"(ep {topology.ep} inside dp), {topology.gpus_per_node} per node", flush=True)
            m = config.model
            print(routing_statement(topology.ep, topology.gpus_per_node, m.moe_router_num_groups,
                                    m.moe_router_group_topk, m.moe_router_topk), flush=True)
        refuse_at_start_up(config, topology, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # before logging.dir
        lock = claim_on_rank_0(config, topology)
        trainer = Trainer(config, topology, stop)
    except RunDirError as err:  # rank 0's outcome, told once
        if topology is None or topology.rank == 0:
            print(f"error: {err}", file=sys.stderr)
        if topology is not None:  # every rank is here: leave the process group before exiting, not at exit
            topology.destroy_groups()
            dist.destroy_process_group()
        return EXIT_BAD_INPUT
    except (ConfigError, DataError, CheckpointError, DispatcherUnavailable) as err:
        print(f"error: {err}", file=sys.stderr)
        if lock is not None:
            lock.release()
        return EXIT_BAD_INPUT
    except LogWriteError as err:  # metrics.jsonl rewritten on resume, config.yaml: as a write failure mid-run
        print(f"error: {err}", file=sys.stderr)
        if lock is not None:
            lock.release()
        return EXIT_WRITE_FAILED
    except RuntimeError as err:
        line = collective_failure_line(err, topology, "during start-up")
        if line is None:
            raise
        print(line, file=sys.stderr, flush=True)
        if lock is not None:
            lock.release()
        return EXIT_PEER_FAILED
    try:
        return trainer.train()
    finally:
        if lock is not None:
            lock.release()
        if trainer.pipeline is not None:
            trainer.pipeline.destroy()
        if topology is not None:
            topology.destroy_groups()
            dist.destroy_process_group()


if __name__ == "__main__":
    status = main(stop=StopRequest().install())  # noted until the end, also while the process group closes
    ignore_stop_signals()
    sys.exit(status)
