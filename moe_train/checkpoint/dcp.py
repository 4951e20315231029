"""Checkpoints in Megatron's layout, written with torch.distributed.checkpoint (DCP) and published atomically.

Layout under a checkpoint root:

    latest_checkpointed_iteration.txt   the step of the newest complete checkpoint
    iter_0000100/
        .metadata, __<rank>_0.distcp    DCP: {"model": ..., "optim": ..., "ema": ...} (ema: with
                                        optim.ema_decay), keyed by parameter name and global
                                        expert id, so any layout loads any other's
        extra.pt                        rank 0's `extra` dict (step, consumed samples, schedules, ...)
        rng_rank<r>.pt                  RNG states (python, numpy, torch CPU, CUDA) of global rank r
        config.yaml, ...                the `text_files` given to `save_checkpoint`

A save writes everything into `iter_XXXXXXX.tmp`, fsyncs files and folders, renames the folder to
its final name, then replaces the latest file (write, fsync, `os.replace`), and only then deletes
checkpoints older than the newest `keep`. A process killed at any moment therefore leaves the
latest file pointing to a complete folder; what a killed save left behind ends in `.tmp` and is
removed by the next save. Loading runs no code from a checkpoint: its pickled files (DCP's metadata,
extra.pt, the RNG files) are read with allow-lists (moe_train.checkpoint.safe_unpickle), and a file that names
anything else is refused in one line.

`BackgroundSaves` writes the same folders with DCP's async save: the state is copied to host memory, a
thread writes the copy while training goes on, and the folder is published (the same rename, latest
file and pruning) only once every rank's write has finished.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import io
import os
import random
import re
import resource
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.futures import Future
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.staging import AsyncStager

from moe_train.atomic import fsync_dir, publish_bytes, write_durable
from moe_train.checkpoint.safe_unpickle import UnsafePickle, load_dcp_metadata, load_plain
from parallel.flat_range import FlatRange
from parallel.mixed_precision import checkpoint_values, set_parameters
from parallel.sharded_state import ADAM_STATE, model_state, optimizer_state

LATEST_FILE = "latest_checkpointed_iteration.txt"
EXTRA_FILE = "extra.pt"
METADATA_FILE = ".metadata"
TMP_SUFFIX = ".tmp"
HF_CONFIG_FILE = "config.json"  # marks a Hugging Face folder (moe_train.checkpoint.hf_checkpoint)
_ITER_PATTERN = re.compile(r"iter_([0-9]{7,})")
_EXPERT_KEY = re.compile(r"(.+)\.expert_([0-9]+)")
_MOMENT_KEY = re.compile(rf"optim\..+\.({'|'.join(ADAM_STATE)})(\.expert_[0-9]+)?")
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, found or loaded; the message names the path or tensor."""


def corrupt_file(file: Path, err: BaseException) -> CheckpointError:
    """The one line for a checkpoint file that cannot be unpickled; torch's own message names no file and
    may suggest weights_only=False, which would run whatever code a damaged or foreign file holds."""
    return CheckpointError(f"{file} is corrupt or not a checkpoint of this program ({type(err).__name__})")


def refused_file(file: Path, err: UnsafePickle) -> CheckpointError:
    """The one line for a pickled checkpoint file that names code outside its allow-list; nothing of it ran."""
    return CheckpointError(f"{file}: refused to load {', '.join(err.names)}: checkpoints of this program never "
                           "hold code, so this file was not written by it or was altered (nothing of it was run)")


class NamingReader(dcp.FileSystemReader):
    """DCP's reader, one data file at a time, so that a file that cannot be read is named (`corrupt_file`),
    and reading the metadata through the allow-list of moe_train.checkpoint.safe_unpickle instead of a full unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        file = Path(self.path) / METADATA_FILE
        try:
            with open(file, "rb") as stream:
                metadata = load_dcp_metadata(stream)
        except UnsafePickle as err:
            raise refused_file(file, err) from None
        except Exception as err:  # any unpickling failure means a corrupt file
            raise corrupt_file(file, err) from err
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{file} is not DCP metadata (it holds a {type(metadata).__name__})")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as err:  # any unpickling or archive failure means a corrupt file
                raise corrupt_file(Path(self.path) / name, err) from err
        done: Future[None] = Future()
        done.set_result(None)
        return done


def iteration_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def list_iterations(root: str | os.PathLike) -> list[int]:
    """Steps of the `iter_*` folders under `root`, ascending (temporary folders excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    matches = (_ITER_PATTERN.fullmatch(entry.name) for entry in root.iterdir() if entry.is_dir())
    return sorted(int(match.group(1)) for match in matches if match)


def write_latest(root: str | os.PathLike, step: int) -> None:
    latest = Path(root) / LATEST_FILE
    publish_bytes(latest, f"{step}\n".encode(), temp=_tmp_name(latest), durable=True)


def latest_iteration(root: str | os.PathLike) -> int | None:
    """The step in the latest file; None when there is no latest file.

    Raises CheckpointError when the file is unreadable or does not hold a step, or when the folder
    it points to is missing or incomplete.
    """
    path = Path(root) / LATEST_FILE
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: cannot read the latest file: {err}") from err
    if not re.fullmatch(r"[0-9]+", text):
        raise CheckpointError(f"{path}: expected an iteration number, found {text[:60]!r}")
    step = int(text)
    folder = iteration_dir(root, step)
    if not folder.is_dir():
        raise CheckpointError(f"{path} points to iteration {step}, but {folder} does not exist")
    missing = [name for name in (METADATA_FILE, EXTRA_FILE) if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(f"{path} points to {folder}, which is incomplete (no {', '.join(missing)})")
    return step


def resolve_resume(resume: str, root: str | os.PathLike) -> Path | None:
    """The checkpoint folder that `checkpoint.resume` selects, or None to start from scratch.

    "auto": the latest checkpoint under `root`, if any; "none": None; anything else is a path to
    an iteration folder, a checkpoint root holding a latest file, or a Hugging Face folder.
    """
    if resume == "none":
        return None
    if resume == "auto":
        step = latest_iteration(root)
        return None if step is None else iteration_dir(root, step)
    return checkpoint_folder(resume, "checkpoint.resume", hf=True)


def checkpoint_folder(path: str | os.PathLike, what: str, hf: bool = False) -> Path:
    """The iteration folder `path` names: itself, or the latest one of a checkpoint root (or, with `hf`,
    a Hugging Face folder); `what` (the option it came from) starts the CheckpointError otherwise."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{what}: {path} does not exist")
    if (path / METADATA_FILE).is_file():
        return path
    if (path / LATEST_FILE).is_file():
        return iteration_dir(path, latest_iteration(path))
    if hf and is_hf_folder(path):
        return path
    kinds = [f"a checkpoint folder (no {METADATA_FILE})", f"a checkpoint root (no {LATEST_FILE})"]
    if hf:
        kinds.append(f"a Hugging Face folder (no {HF_CONFIG_FILE})")
    raise CheckpointError(f"{what}: {path} is neither {', '.join(kinds[:-1])} nor {kinds[-1]}")


def is_hf_folder(path: Path) -> bool:
    return (path / HF_CONFIG_FILE).is_file() and not (path / METADATA_FILE).is_file()


def save_checkpoint(root: str | os.PathLike, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    extra: dict, keep: int, text_files: dict[str, str] | None = None,
                    process_group: dist.ProcessGroup | None = None,
                    ema: dict[str, torch.Tensor] | None = None) -> Path:
    """Write checkpoint `step` under `root` atomically and return its folder; every rank calls it.

    Optimizer state that does not exist yet (no step taken) is saved as zeros at step 0. `ema`: this
    rank's EMA tensors keyed as the model state (moe_train.ema), saved under `ema.`.
    """
    save = _begin_save(root, step, keep, process_group)
    state = _full_state_dict(model, optimizer, ema)
    needed = _nbytes(state)
    on_all_ranks(lambda: quiet_dcp(dcp.save, state, storage_writer=dcp.FileSystemWriter(save.tmp),
                                     process_group=process_group), process_group, save.what, (save.root, needed))
    _finish_save(save, extra, text_files, process_group)
    return save.final


@dataclasses.dataclass
class _Save:
    """One checkpoint being written: `tmp` is published as `final` once complete."""
    root: Path
    step: int
    keep: int
    final: Path
    tmp: Path
    coordinator: bool
    rng: dict[str, Any]

    @property
    def what(self) -> str:
        return f"saving {self.final}"


def _begin_save(root: str | os.PathLike, step: int, keep: int, group: dist.ProcessGroup | None) -> _Save:
    """Capture the RNG states and create the empty temporary folder (rank 0), removing what killed saves left."""
    if keep < 1 or step < 0:
        raise CheckpointError(f"{root}: cannot save step {step} keeping {keep}: need step >= 0 and keep >= 1")
    final = iteration_dir(root, step)
    save = _Save(Path(root), step, keep, final, _tmp_name(final), _rank(group) == 0, capture_rng_state())
    on_all_ranks(lambda: _prepare_root(save.root, save.tmp) if save.coordinator else None, group, save.what)
    return save


def _finish_save(save: _Save, extra: dict, text_files: dict[str, str] | None, group: dist.ProcessGroup | None) -> None:
    """Once every rank's tensors are written: the small files, then rank 0 publishes the folder."""
    on_all_ranks(lambda: _write_rank_files(save.tmp, save.rng, extra, text_files, save.coordinator), group, save.what)
    on_all_ranks(lambda: _publish(save.root, save.tmp, save.final, save.step, save.keep) if save.coordinator else None,
                 group, save.what)


def _nbytes(state: dict[str, Any]) -> int:
    return sum((t.values if isinstance(t, FlatRange) else t).nbytes for _, t in _flat_tensors(state))


class HostCopy(AsyncStager):
    """DCP's stager for `BackgroundSaves`: a copy of the state in host memory that training cannot change.

    DCP's own stager cannot copy the `FlatRange`s of ZeRO-1 pieces (parallel.flat_range), so each
    range is copied as its values. The copy is made before `dcp.async_save` returns.
    """
    _synchronize_after_execute = False  # the copy is complete when `stage` returns

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return _host_copy(state_dict)


def _host_copy(tree: Any) -> Any:
    if isinstance(tree, FlatRange):
        return FlatRange(tree.shape, tree.start, tree.values.detach().to("cpu", copy=True))
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {key: _host_copy(value) for key, value in tree.items()}
    return tree


@dataclasses.dataclass
class _Write:
    """A checkpoint whose tensors DCP is writing in the background."""
    save: _Save
    future: concurrent.futures.Future
    needed: int


class BackgroundSaves:
    """Checkpoints written while training goes on (checkpoint.async_save), at most one in flight.

    `start` copies the state to host memory (`HostCopy`), writes the small files, and hands the copy to
    `dcp.async_save`; the folder keeps its temporary name until `poll` (at each step boundary) finds every
    rank's write finished, or `wait` blocks for it; then it is published as `save_checkpoint` publishes,
    so the latest file only ever names complete checkpoints. A failed write raises CheckpointError there.
    Every rank makes the same calls. Distributed, DCP's writing thread has a gloo group of its own and the
    main thread's exchanges another, so neither meets the other's (or training's) collectives.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self._groups: list[dist.ProcessGroup] = []
        if dist.is_available() and dist.is_initialized():
            ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
            self._groups = [dist.new_group(ranks, backend="gloo") for _ in range(2)]
        else:  # DCP warns from its writing thread, where quiet_dcp's catch_warnings does not reach
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        self._pending: _Write | None = None

    @property
    def _control(self) -> dist.ProcessGroup | None:
        return self._groups[0] if self._groups else None

    @property
    def _writer(self) -> dist.ProcessGroup | None:
        return self._groups[1] if self._groups else None

    def start(self, root: str | os.PathLike, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
              extra: dict, keep: int, text_files: dict[str, str] | None = None,
              ema: dict[str, torch.Tensor] | None = None) -> Path:
        """Wait for (and publish) the save in flight, then start writing checkpoint `step`; returns its folder."""
        self.wait()
        save = _begin_save(root, step, keep, self._control)
        state = _full_state_dict(model, optimizer, ema)
        on_all_ranks(lambda: _write_rank_files(save.tmp, save.rng, extra, text_files, save.coordinator),
                     self._control, save.what)
        future = on_all_ranks(lambda: dcp.async_save(state, storage_writer=dcp.FileSystemWriter(save.tmp),
                                                     process_group=self._writer, async_stager=HostCopy()),
                              self._control, save.what)
        self._pending = _Write(save, future, _nbytes(state))
        return save.final

    def poll(self) -> Path | None:
        """Publish the save in flight if every rank's write has finished; returns the folder published."""
        if self._pending is None:
            return None
        done = torch.tensor([float(self._pending.future.done())])
        if self._control is not None:
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._control)
        return self._publish() if done.item() else None

    def wait(self) -> Path | None:
        """Wait for the save in flight and publish it; returns the folder published."""
        if self._pending is None:
            return None
        concurrent.futures.wait([self._pending.future])
        return self._publish()

    def close(self) -> None:
        """Let a write still in flight end, unpublished (a run stopping on an error), and free the groups."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending.future])
            self._pending = None
        for group in self._groups:
            dist.destroy_process_group(group)
        self._groups = []

    def _publish(self) -> Path:
        write, self._pending = self._pending, None
        save = write.save
        on_all_ranks(write.future.result, self._control, save.what, (save.root, write.needed))
        on_all_ranks(lambda: _publish(save.root, save.tmp, save.final, save.step, save.keep)
                     if save.coordinator else None, self._control, save.what)
        return save.final


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    weights_only: bool = False, restore_rng: bool = True,
                    process_group: dist.ProcessGroup | None = None, partial: bool = False,
                    ema: dict[str, torch.Tensor] | None = None) -> dict:
    """Load a checkpoint folder into `model` (and `optimizer`, and the EMA tensors `ema`, keyed as in
    `save_checkpoint`; the checkpoint must hold them: `holds_ema`) in place and return its `extra` dict.

    weights_only loads the model alone (fine-tuning): optimizer, EMA, RNG and `extra` are left out and
    {} is returned. `partial`: the model is one pipeline stage, so tensors of other stages in the
    checkpoint are expected. Shapes, data files, `extra` and RNG files are checked before any tensor is
    overwritten, so a mismatching or damaged checkpoint leaves the model as it was.
    """
    path = Path(path)
    values = checkpoint_values(model, loading=True)
    state = _full_state_dict(model, None if weights_only else optimizer, None if weights_only else ema, values)
    read_back = on_all_ranks(lambda: _check_and_read(path, state, weights_only, restore_rng, partial),
                              process_group, f"loading {path}")
    on_all_ranks(lambda: quiet_dcp(dcp.load, state, storage_reader=NamingReader(path),
                                     process_group=process_group), process_group, f"loading {path}")
    set_parameters(model, values)
    if weights_only:
        return {}
    extra, rng = read_back
    if rng is not None:
        restore_rng_state(rng)
    return extra


def capture_rng_state() -> dict[str, Any]:
    """This process's python, numpy, torch CPU and (when available) CUDA generator states."""
    numpy_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {**numpy_state, "state": {"key": numpy_state["state"]["key"].tolist(),
                                           "pos": numpy_state["state"]["pos"]}},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for device, cuda_state in zip(range(torch.cuda.device_count()), state["cuda"]):
            torch.cuda.set_rng_state(cuda_state, device)


def model_mismatches(metadata: Metadata, model_state: dict[str, torch.Tensor], partial: bool = False) -> list[str]:
    """Every model tensor missing from, unexpected in or shaped differently in the checkpoint.

    Per-expert keys the checkpoint has but this rank does not hold are not "unexpected": under
    expert parallelism they belong to other ranks (an expert-count change shows as a router shape
    mismatch instead). With `partial` (a pipeline stage) no saved key is unexpected. Per-expert problems are listed once per tensor with the expert ids.
    """
    saved = _saved_shapes(metadata, "model.")
    problems = [("missing in checkpoint", name, f"{list(tensor.shape)}")
                for name, tensor in model_state.items() if name not in saved]
    problems += [("unexpected in checkpoint", name, f"{shape}") for name, shape in saved.items()
                 if name not in model_state and not _EXPERT_KEY.fullmatch(name) and not partial]
    problems += [("shape mismatch", name, f"checkpoint {saved[name]} vs model {list(tensor.shape)}")
                 for name, tensor in model_state.items() if name in saved and saved[name] != list(tensor.shape)]
    return _group_experts(problems)


def _group_experts(problems: list[tuple[str, str, str]]) -> list[str]:
    """'kind: name detail' lines; per-expert keys of one tensor merged into 'name experts 8-15'."""
    grouped: dict[tuple[str, str, str], list[int]] = {}
    lines = []
    for kind, name, detail in problems:
        match = _EXPERT_KEY.fullmatch(name)
        if match is None:
            lines.append(f"{kind}: {name} {detail}")
        else:
            grouped.setdefault((kind, match.group(1), detail), []).append(int(match.group(2)))
    for (kind, name, detail), experts in grouped.items():
        lines.append(f"{kind}: {name} experts {_ranges(sorted(experts))} {detail}")
    return lines


def _ranges(ids: list[int]) -> str:
    spans, start = [], ids[0]
    for prev, cur in zip(ids, ids[1:] + [None]):
        if cur != prev + 1:
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(spans)


def read_metadata(path: str | os.PathLike) -> Metadata:
    """DCP metadata of a checkpoint folder, or CheckpointError naming what is missing or corrupt."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint folder")
    metadata_path = path / METADATA_FILE
    if not metadata_path.is_file():
        raise CheckpointError(f"{path}: no {METADATA_FILE} file, not a complete DCP checkpoint")
    return NamingReader(path).read_metadata()


def holds_ema(metadata: Metadata) -> bool:
    """Whether a checkpoint (its DCP metadata) holds an EMA of the parameters."""
    return bool(_saved_shapes(metadata, "ema."))


def saved_moment_dtypes(path: str | os.PathLike) -> set[torch.dtype]:
    """The dtypes of the Adam moments in a checkpoint folder (empty without optimizer state)."""
    return {item.properties.dtype for key, item in read_metadata(path).state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata) and _MOMENT_KEY.fullmatch(key)}


def _tmp_name(path: Path) -> Path:
    return path.with_name(path.name + TMP_SUFFIX)


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _one_line(error: BaseException) -> str:
    """`Type: first line`; for DCP's CheckpointException (a BaseException holding each rank's
    exception and traceback) that of the first failed rank's exception, a CheckpointError's as it is."""
    if isinstance(error, CheckpointException) and error.failures:
        error, _trace = next(iter(error.failures.values()))
    if isinstance(error, CheckpointError):  # raised inside DCP, already one line
        return str(error)
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _write_limit(folder: Path, needed: int) -> str:
    """Why writing `needed` bytes under `folder` cannot succeed ('' if no limit explains it): a full
    disk, or a file size limit. torch's writer reports a short write as 'unexpected pos'."""
    try:
        free = shutil.disk_usage(folder if folder.exists() else folder.parent).free
    except OSError:
        return ""
    if free < needed:
        return f" (no space left on device: {free} bytes free, the checkpoint needs about {needed})"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and limit < needed:
        return f" (the file size limit, ulimit -f, is {limit} bytes)"
    return ""


def on_all_ranks(fn: Callable[[], Any], group: dist.ProcessGroup | None, what: str,
                  writes: tuple[Path, int] | None = None) -> Any:
    """fn() on this rank, then an exchange of outcomes so that every rank raises if any rank failed.

    Without it a rank that failed alone would leave the others waiting in the next collective.
    `writes`: (folder, bytes) a write needs there, to name a full disk or a file size limit as the cause.
    """
    try:
        result, error = fn(), None
    except (Exception, CheckpointException) as err:  # reported to every rank below
        result, error = None, err
    message = None
    if error is not None:
        message = str(error) if isinstance(error, CheckpointError) else _one_line(error)
        if writes is not None and not isinstance(error, CheckpointError):
            message += _write_limit(*writes)
    messages = [message]
    if dist.is_available() and dist.is_initialized():
        gathered: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, messages[0], group=group)
        messages = gathered
    if isinstance(error, CheckpointError):
        raise error
    if error is not None:
        raise CheckpointError(f"{what}: {messages[_rank(group)]}") from error
    failed = [f"rank {rank}: {message}" for rank, message in enumerate(messages) if message]
    if failed:
        raise CheckpointError(f"{what} failed on other ranks: " + "; ".join(failed))
    return result


def quiet_dcp(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a DCP entry point without its warning that a single process is not distributed."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, **kwargs)


def _full_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                     ema: dict[str, torch.Tensor] | None = None,
                     values: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Layout-independent views of the live tensors (see parallel.sharded_state); DCP loads in place.
    `values`: the model's, as `model_state` takes them (default: what this rank saves)."""
    state: dict[str, Any] = {"model": model_state(model, values)}
    if optimizer is not None:
        state["optim"] = optimizer_state(model, optimizer)
    if ema is not None:
        state["ema"] = ema
    return state


def _prepare_root(root: Path, tmp: Path) -> None:
    """Create `root`, remove what killed saves left behind, and create the empty temporary folder."""
    root.mkdir(parents=True, exist_ok=True)
    for entry in root.iterdir():
        if entry.name.endswith(TMP_SUFFIX) and entry.name.startswith(("iter_", LATEST_FILE)):
            _remove(entry)
    tmp.mkdir()


def _write_rank_files(tmp: Path, rng: dict[str, Any], extra: dict, text_files: dict[str, str] | None,
                      coordinator: bool) -> None:
    write_durable(tmp / f"rng_rank{_global_rank()}.pt", _to_bytes(rng))
    if coordinator:
        write_durable(tmp / EXTRA_FILE, _to_bytes(extra))
        for name, text in (text_files or {}).items():
            write_durable(tmp / name, text.encode())


def _publish(root: Path, tmp: Path, final: Path, step: int, keep: int) -> None:
    fsync_dir(tmp)
    _install(tmp, final)
    fsync_dir(root)
    write_latest(root, step)
    _prune(root, step, keep)


def _install(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; a `final` that exists already (the same step saved again) is replaced.

    The replacement swaps the two folders in one `renameat2(RENAME_EXCHANGE)` where the OS allows,
    so a latest file pointing to `final` never sees it missing.
    """
    if not final.exists():
        os.rename(tmp, final)
        return
    if _exchange(tmp, final):
        _remove(tmp)
        return
    _discard(final)
    os.rename(tmp, final)


def _exchange(a: Path, b: Path) -> bool:
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _prune(root: Path, step: int, keep: int) -> None:
    """Delete all but the newest `keep - 1` checkpoints older than `step`; newer ones are left alone."""
    older = [s for s in list_iterations(root) if s < step]
    for old in older[:max(0, len(older) - (keep - 1))]:
        _discard(iteration_dir(root, old))


def _discard(folder: Path) -> None:
    """Rename to a temporary name first, so that a half-deleted folder never keeps a valid name."""
    doomed = folder.with_name(folder.name + ".old" + TMP_SUFFIX)
    _remove(doomed)
    os.rename(folder, doomed)
    _remove(doomed)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _check_and_read(path: Path, state: dict[str, Any], weights_only: bool, restore_rng: bool,
                    partial: bool) -> tuple[dict, dict | None] | None:
    """Validate the folder against `state`; return (extra, this rank's RNG state) unless weights_only."""
    metadata = read_metadata(path)
    _check_storage_files(path, metadata)
    problems = model_mismatches(metadata, state["model"], partial)
    if "optim" in state:
        problems += _optimizer_mismatches(metadata, state["optim"])
    if "ema" in state:
        problems += _missing_or_misshaped(metadata, "ema.", state["ema"], "EMA")
    if problems:
        raise CheckpointError(f"{path} does not match the model:\n  " + "\n  ".join(problems))
    if weights_only:
        return None
    return _read_extra(path), _read_rng(path) if restore_rng else None


def _check_storage_files(path: Path, metadata: Metadata) -> None:
    """Every data file the metadata refers to exists and is long enough for its last item."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{file} is missing")
        elif file.stat().st_size < size:
            problems.append(f"{file} is truncated: {file.stat().st_size} bytes, the metadata needs {size}")
    if problems:
        raise CheckpointError(f"{path}: corrupt checkpoint: " + "; ".join(problems))


def _saved_shapes(metadata: Metadata, prefix: str) -> dict[str, list[int]]:
    return {key[len(prefix):]: list(item.size) for key, item in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)}


def _optimizer_mismatches(metadata: Metadata, optim_state: dict[str, Any]) -> list[str]:
    if not _saved_shapes(metadata, "optim."):
        return ["no optimizer state in checkpoint (load it with weights_only)"]
    return _missing_or_misshaped(metadata, "optim.", optim_state, "optimizer")


def _missing_or_misshaped(metadata: Metadata, prefix: str, state: dict[str, Any], what: str) -> list[str]:
    """The tensors of `state` that the checkpoint lacks under `prefix` or holds in another shape."""
    saved = _saved_shapes(metadata, prefix)
    problems = []
    for name, tensor in _flat_tensors(state):
        if name not in saved:
            problems.append((f"missing in checkpoint: {what}", name, f"{list(tensor.shape)}"))
        elif saved[name] != list(tensor.shape):
            problems.append((f"shape mismatch: {what}", name, f"checkpoint {saved[name]} vs {list(tensor.shape)}"))
    return _group_experts(problems)


def _flat_tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted key, tensor) pairs of a nested dict/list, keyed the way DCP flattens them."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flat_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from _flat_tensors(value, f"{prefix}.{index}" if prefix else str(index))


def _read_plain(file: Path) -> Any:
    """A file of ours holding only tensors, numbers, strings and containers (moe_train.checkpoint.safe_unpickle)."""
    try:
        return load_plain(file)
    except FileNotFoundError as err:
        raise CheckpointError(f"{file} is missing") from err
    except UnsafePickle as err:
        raise refused_file(file, err) from None
    except Exception as err:  # any unpickling failure means a corrupt file
        raise corrupt_file(file, err) from err


def _read_extra(path: Path) -> dict:
    """The `extra` dict (step, data position, ...): plain values only."""
    return _read_plain(path / EXTRA_FILE)


def _read_rng(path: Path) -> dict | None:
    """This rank's RNG state; None with a warning when the checkpoint has none for it (resharding)."""
    file = path / f"rng_rank{_global_rank()}.pt"
    if not file.is_file():
        warnings.warn(f"{file} does not exist: RNG states not restored on this rank")
        return None
    return _read_plain(file)
