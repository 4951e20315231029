"""The training loop: `python -m moe_train.train --config FILE [--set section.key=value ...]`.

Single-process today, written so data/expert/pipeline parallelism plug in without a rewrite:
losses are averaged over the global batch, the data order depends only on the seed, and the
router bias update uses expert loads of the whole global batch.
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch

from model.flops import training_flops_per_token
from model.init import initialize_parameters
from model.moe import set_aux_loss_grad_scale
from model.transformer import DeepSeekV3
from moe_train.checkpoint import CheckpointError, load_checkpoint, resolve_resume, save_checkpoint
from moe_train.config import Config, ConfigError, load_config, to_yaml
from moe_train.data import BatchSampler, DataError, build_datasets, build_demo_corpus, check_vocab, load_tokenizer
from moe_train.metrics import MetricsLogger, format_duration
from moe_train.optim import build_optimizer, set_learning_rate
from moe_train.runtime import autocast, configure_threads, seed_everything, select_device
from moe_train.schedules import bias_update_rate, learning_rate, mtp_loss_scale

EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
LOSS_PARTS = ("lm_loss", "mtp_loss", "aux_loss")


class TrainingDiverged(RuntimeError):
    pass


def default_cache_dir() -> str:
    return os.environ.get("MOE_TRAIN_CACHE", str(Path.home() / ".cache" / "moe_train"))


def require_single_process() -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ConfigError([("parallel", f"this build trains in one process; WORLD_SIZE={world} was launched "
                                        "(set NPROC_PER_NODE=1 / parallel.nproc_per_node=1)")])


class Trainer:
    def __init__(self, config: Config) -> None:
        require_single_process()
        self.cfg = config
        configure_threads(config.train)
        seed_everything(config.train.seed)
        self.device = select_device(config.train)
        self.run_dir = Path(config.logging.dir)
        self.tokenizer = load_tokenizer(config.data.tokenizer)
        prefix = config.data.path or build_demo_corpus(config.data.cache_dir or default_cache_dir(), self.tokenizer,
                                                      max_bytes=config.data.demo_max_bytes, show_progress=True)
        self.train_data, self.valid_data = build_datasets(prefix, config.train.seq_length, config.train.seed,
                                                          config.data.valid_fraction, eod_id=self.tokenizer.eod_id)
        check_vocab(self.train_data.dataset, config.model.vocab_size)
        self.model = DeepSeekV3(config.model)
        initialize_parameters(self.model, config.train.seed, config.model.init_method_std)
        self.model.to(self.device)
        self.optimizer = build_optimizer(self.model, config.optim)
        self.sampler = BatchSampler(self.train_data, config.train.global_batch_size, config.train.micro_batch_size)
        self.step = 0
        self.stop_signal: int | None = None
        self._resume()
        self.logger = MetricsLogger(self.run_dir, config.train.steps, enabled=True,
                                    tensorboard=config.logging.tensorboard, resume_step=self.step)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(config))
        self.flops_per_token = training_flops_per_token(config.model, config.train.seq_length,
                                                        with_mtp=config.model.mtp_num_layers > 0)

    def _resume(self) -> None:
        ckpt = self.cfg.checkpoint
        path = resolve_resume(ckpt.resume, self.cfg.checkpoint_dir)
        if path is None:
            return
        extra = load_checkpoint(path, self.model, None if ckpt.weights_only else self.optimizer,
                                weights_only=ckpt.weights_only)
        if not ckpt.weights_only:
            self.step = extra["step"]
            self.sampler.load_state_dict(extra["data"])
        print(f"resumed from {path} at step {self.step}", flush=True)

    def save(self) -> Path:
        extra = {"step": self.step, "data": self.sampler.state_dict(),
                 "consumed_samples": self.sampler.consumed_samples}
        return save_checkpoint(self.cfg.checkpoint_dir, self.step, self.model, self.optimizer, extra,
                               keep=self.cfg.checkpoint.keep, text_files={"config.yaml": to_yaml(self.cfg)})

    def _forward_backward(self, micro_batches: list[torch.Tensor], mtp_scale: float) -> dict[str, float]:
        sums = dict.fromkeys(LOSS_PARTS, 0.0)
        sums["loss"] = 0.0
        scale = 1.0 / len(micro_batches)
        set_aux_loss_grad_scale(scale)
        for rows in micro_batches:
            rows = rows.to(self.device, non_blocking=True)
            with autocast(self.device, self.cfg.train.precision):
                out = self.model(rows[:, :-1], rows[:, 1:], mtp_loss_scale=mtp_scale)
            (out.loss * scale).backward()
            for part in LOSS_PARTS:
                sums[part] += getattr(out, part).item() * scale
            sums["loss"] += out.loss.item() * scale
        return sums

    def _check_finite(self, losses: dict[str, float]) -> None:
        for part in ("loss", *LOSS_PARTS):
            if not math.isfinite(losses[part]):
                raise TrainingDiverged(f"non-finite {part} ({losses[part]}) at step {self.step + 1}; "
                                       f"stopping without saving, the last good checkpoint is kept")

    def _update_router_biases(self, rate: float) -> float:
        """Bias update from this step's expert loads; returns the worst max/mean load ratio."""
        worst = 0.0
        for router in self.model.routers():
            load = router.expert_load
            worst = max(worst, (load.max() / load.mean().clamp_min(1e-9)).item())
            router.apply_bias_update(load, rate)
            load.zero_()
        return worst

    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        lr = learning_rate(self.step, cfg.optim, cfg.train.steps)
        set_learning_rate(self.optimizer, lr)
        start = time.perf_counter()
        losses = self._forward_backward(self.sampler.next_batch(), mtp_loss_scale(self.step, cfg.optim, cfg.model))
        self._check_finite(losses)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.clip_grad or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        load_ratio = self._update_router_biases(bias_update_rate(self.step, cfg.optim, cfg.model))
        self.step += 1
        elapsed = time.perf_counter() - start
        tokens = cfg.train.global_batch_size * cfg.train.seq_length
        return {**losses, "lr": lr, "grad_norm": grad_norm.item(), "tokens_per_s": tokens / elapsed,
                "expert_load_max_over_mean": load_ratio, "step_time_s": elapsed}

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        mbs, total = self.cfg.train.micro_batch_size, 0.0
        for i in range(self.cfg.train.eval_iters):
            rows = self.valid_data.rows(i * mbs, mbs).to(self.device)
            with autocast(self.device, self.cfg.train.precision):
                total += self.model(rows[:, :-1], rows[:, 1:]).lm_loss.item()
        self.model.train()
        return total / self.cfg.train.eval_iters

    def _on_signal(self, signum: int, _frame) -> None:
        self.stop_signal = signum

    def train(self) -> int:
        cfg = self.cfg
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(signum, self._on_signal)
        self.model.train()
        self.logger.info(f"training {cfg.train.steps} steps from step {self.step} on {self.device} "
                         f"({cfg.train.precision}); logs in {self.run_dir}")
        step_times: list[float] = []
        try:
            while self.step < cfg.train.steps:
                metrics = self.train_step()
                step_times.append(metrics.pop("step_time_s"))
                self._log(metrics, step_times)
                if cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0:
                    self.save()
                if self.stop_signal is not None:
                    path = self.save()
                    self.logger.info(f"received {signal.Signals(self.stop_signal).name}: saved {path}, exiting")
                    return 0
            if not cfg.checkpoint.interval or self.step % cfg.checkpoint.interval:
                self.save()
        except TrainingDiverged as err:
            self.logger.info(f"error: {err}")
            return EXIT_DIVERGED
        finally:
            self.logger.close()
        self.logger.info(f"done: {self.step} steps in {format_duration(sum(step_times))}")
        return 0

    def _log(self, metrics: dict[str, float], step_times: list[float]) -> None:
        cfg = self.cfg
        evaluate = cfg.train.eval_interval and self.valid_data is not None and self.step % cfg.train.eval_interval == 0
        if self.step % cfg.train.log_interval and not evaluate and self.step != cfg.train.steps:
            return
        recent = step_times[-20:]
        record = {"step": self.step, **metrics,
                  "consumed_samples": self.sampler.consumed_samples,
                  "eta_s": (cfg.train.steps - self.step) * sum(recent) / len(recent)}
        if self.device.type == "cuda":
            record["mfu"] = metrics["tokens_per_s"] * self.flops_per_token / (cfg.train.peak_tflops * 1e12)
        if evaluate:
            record["valid_loss"] = self.evaluate()
        self.logger.log(record)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moe-train", description="Train a DeepSeek-V3-like MoE model.")
    parser.add_argument("--config", required=True, help="YAML config (see moe_train/configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value; repeatable")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        trainer = Trainer(load_config(args.config, args.overrides))
    except (ConfigError, DataError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return trainer.train()


if __name__ == "__main__":
    sys.exit(main())
