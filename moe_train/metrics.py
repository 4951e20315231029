"""Step metrics: one console line, `metrics.jsonl`, TensorBoard scalars when installed, and optionally
Weights & Biases."""
from __future__ import annotations

import json
import math
import os
import sys
import uuid
from pathlib import Path
from typing import Any, TextIO

from moe_train.data.atomic import temp_path_for

METRICS_FILE = "metrics.jsonl"


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def console_line(m: dict[str, Any], total_steps: int) -> str:
    parts = [f"step {m['step']:>{len(str(total_steps))}}/{total_steps}",
             f"loss {m['loss']:.4f} (lm {m['lm_loss']:.4f} mtp {m['mtp_loss']:.4f} aux {m['aux_loss']:.2e})",
             f"lr {m['lr']:.2e}", f"grad {m['grad_norm']:.3f}", f"{m['tokens_per_s']:,.0f} tok/s",
             f"load max/mean {m['expert_load_max_over_mean']:.2f}"]
    if "mfu" in m:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    if m.get("skipped_steps"):
        parts.append(f"skipped {m['skipped_steps']}")
    if "valid_loss" in m:
        parts.append(f"valid {m['valid_loss']:.4f}")
    parts.append(f"ETA {format_duration(m['eta_s'])}")
    return " | ".join(parts)


class LogWriteError(RuntimeError):
    """A log file that cannot be written or read back; the message names the path and the error."""


def truncate_after(path: Path, step: int) -> None:
    """Drop records past `step` (a resumed run rewrites them), replacing the file atomically.

    A torn last line (a run stopped while writing it, or a full disk) is dropped with a warning.
    """
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number < len(lines):
                raise LogWriteError(f"{path}: line {number} is not a JSON record ({err}); fix or move the file") from None
            print(f"warning: {path}: dropped a torn last line ({len(line)} characters)", file=sys.stderr, flush=True)
            continue
        if record["step"] <= step:
            kept.append(line)
    tmp = Path(temp_path_for(str(path)))
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


TENSORBOARD_MISSING = ("note: tensorboard is not installed, so no TensorBoard scalars are written "
                       "(pip install tensorboard, or set logging.tensorboard=false)")


def wandb_module() -> Any | None:
    """The `wandb` package, or None when it is not installed."""
    try:
        import wandb
    except ImportError:
        return None
    return wandb


WANDB_ID_FILE = "wandb/run_id"


def wandb_run_id(run_dir: Path) -> str:
    """The W&B run id of this run directory, made at its first start and kept in `wandb/run_id`, so a
    resumed run logs on into the same W&B run (offline: `wandb sync` joins its folders)."""
    path = run_dir / WANDB_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:12]
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_suffix(".tmp")
    staged.write_text(run_id + "\n")
    staged.replace(path)
    return run_id


class MetricsLogger:
    """Writes only on the logging rank; other ranks get a logger that does nothing.

    `wandb` holds the arguments of `wandb.init` (project, mode, config, ...) to log the same scalars to
    Weights & Biases, with its files under `<run_dir>/wandb` and one W&B run per run directory, resumed
    with it; None: no W&B.
    """

    def __init__(self, run_dir: str | Path, total_steps: int, enabled: bool, tensorboard: bool,
                 resume_step: int = 0, stream: TextIO | None = None, wandb: dict[str, Any] | None = None) -> None:
        self.enabled, self.total_steps, self.stream = enabled, total_steps, stream
        self.writer = self.wandb_run = None
        if not enabled:
            return
        self.path = Path(run_dir) / METRICS_FILE
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            truncate_after(self.path, resume_step)
            self.file = open(self.path, "a")
        except OSError as err:
            raise LogWriteError(f"cannot write {err.filename or self.path}: {err.strerror}") from err
        if wandb is not None:
            self.wandb_run = wandb_module().init(dir=str(run_dir), id=wandb_run_id(Path(run_dir)), resume="allow",
                                                 **wandb)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self.info(TENSORBOARD_MISSING)
                return
            self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=resume_step + 1)

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, file=self.stream or sys.stdout, flush=True)

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        try:
            self.file.write(json.dumps(metrics) + "\n")
            self.file.flush()
        except OSError as err:
            raise LogWriteError(f"cannot write {self.path}: {err.strerror}") from err
        self.info(console_line(metrics, self.total_steps))
        scalars = {f"train/{key}": value for key, value in metrics.items()
                   if key != "step" and isinstance(value, (int, float)) and math.isfinite(value)}
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, metrics["step"])
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=metrics["step"])

    def close(self) -> None:
        if self.enabled:
            try:
                self.file.close()
            except OSError:
                pass  # a failed write was reported when it happened
            if self.writer is not None:
                self.writer.close()
            if self.wandb_run is not None:
                self.wandb_run.finish()
