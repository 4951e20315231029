"""Step metrics: one console line, `metrics.jsonl`, TensorBoard scalars when installed, and optionally
Weights & Biases."""
from __future__ import annotations

import json
import math
import resource
import sys
import uuid
from pathlib import Path
from typing import Any, TextIO

import torch

from moe_train.atomic import publish_bytes
from moe_train.data.errors import DataError

METRICS_FILE = "metrics.jsonl"


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


GIB = 2**30


def peak_memory(device: torch.device) -> dict[str, float]:
    """This process's peak memory since it started, in GiB: on CUDA the caching allocator's most
    allocated and most reserved (what `torch.cuda.max_memory_allocated` / `_reserved` read, no device
    sync), elsewhere the peak resident set size (getrusage's ru_maxrss, KiB on Linux)."""
    if device.type == "cuda":
        return {"mem_allocated_peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
                "mem_reserved_peak_gib": torch.cuda.max_memory_reserved(device) / GIB}
    return {"mem_rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}


def console_line(m: dict[str, Any], total_steps: int) -> str:
    parts = [f"step {m['step']:>{len(str(total_steps))}}/{total_steps}",
             f"loss {m['loss']:.4f} (lm {m['lm_loss']:.4f} mtp {m['mtp_loss']:.4f} aux {m['aux_loss']:.2e})",
             f"lr {m['lr']:.2e}", f"grad {m['grad_norm']:.3f}", f"{m['tokens_per_s']:,.0f} tok/s",
             f"load max/mean {m['expert_load_max_over_mean']:.2f}"]
    if "global_batch_size" in m:  # the step's batch (train.rampup_batch_size) and the samples consumed after it
        parts.insert(1, f"batch {m['global_batch_size']:,} ({m['consumed_samples']:,} samples)")
    if "mfu" in m:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    if "mem_allocated_peak_gib" in m:
        parts.append(f"mem {m['mem_allocated_peak_gib']:.1f}/{m['mem_reserved_peak_gib']:.1f} GiB")
    elif "mem_rss_peak_gib" in m:
        parts.append(f"rss {m['mem_rss_peak_gib']:.2f} GiB")
    if m.get("skipped_steps"):
        parts.append(f"skipped {m['skipped_steps']}")
    if "valid_loss" in m:
        parts.append(f"valid {m['valid_loss']:.4f}")
    parts.append(f"ETA {format_duration(m['eta_s'])}")
    return " | ".join(parts)


class LogWriteError(RuntimeError):
    """A log file that cannot be written; the message names the path and the error (exit 4)."""


class MetricsFileError(DataError):
    """A metrics.jsonl read back on resume holds a line that is not one of this program's records: bad
    input (exit 2), named by file and line, so the user can fix or move it rather than lose it."""


def read_records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) of each record in `path`, a metrics.jsonl; MetricsFileError names the first line
    that is not UTF-8 or not a record (a JSON object with an integer "step").

    A torn last line (a run stopped while writing it, or a full disk) is dropped with a warning.
    """
    lines = [(number, raw) for number, raw in enumerate(path.read_bytes().split(b"\n"), 1) if raw.strip()]
    records = []
    for number, raw in lines:
        try:
            line = raw.decode()
            record = json.loads(line)
        except UnicodeDecodeError as err:
            raise MetricsFileError(f"{path}: line {number} is not UTF-8 text ({err.reason} at byte {err.start}); "
                                   f"fix or move the file") from None
        except json.JSONDecodeError as err:
            if number < lines[-1][0]:
                raise MetricsFileError(f"{path}: line {number} is not a JSON record ({err}); fix or move the file") \
                    from None
            print(f"warning: {path}: dropped a torn last line ({len(line)} characters)", file=sys.stderr, flush=True)
            continue
        if not isinstance(record, dict) or type(record.get("step")) is not int:
            raise MetricsFileError(f'{path}: line {number} is not a metrics record (a JSON object with an integer '
                                   f'"step"); fix or move the file')
        records.append((line, record))
    return records


def truncate_after(path: Path, step: int) -> None:
    """Drop records past `step` (a resumed run rewrites them), replacing the file atomically; a failed
    write leaves the file as it was and no temporary file behind."""
    if not path.exists():
        return
    kept = "".join(line + "\n" for line, record in read_records(path) if record["step"] <= step)
    publish_bytes(path, kept.encode())


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
    publish_bytes(path, (run_id + "\n").encode())
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
            raise LogWriteError(f"cannot write {self.path}: {err.strerror}") from err
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
