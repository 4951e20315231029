"""Checkpoints: round trip, keep-K, latest file, resume resolution, weights-only, errors, kills, gloo,
and background saves (checkpoint.async_save)."""
from __future__ import annotations

import os
import random
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from model.args import ModelArgs
from model.transformer import DeepSeekV3
import torch.distributed.checkpoint as dcp
from moe_train.checkpoint.dcp import (
    LATEST_FILE,
    BackgroundSaves,
    CheckpointError,
    holds_ema,
    iteration_dir,
    latest_iteration,
    list_iterations,
    load_checkpoint,
    read_metadata,
    resolve_resume,
    save_checkpoint,
    saved_moment_dtypes,
)
from parallel.adamw import MOMENT_DTYPES, make_adamw
from tests.unit._checkpoint_writer import build, fill

REPO = Path(__file__).resolve().parents[2]
KILLS = 6


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: with tiny models, OpenMP threads spin for a long time on shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def seed() -> int:
    value = random.SystemRandom().randrange(2**31)
    print(f"seed={value}")
    return value


def train(model: DeepSeekV3, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> list[float]:
    """Real AdamW steps on random tokens, each followed by a router bias update; returns the losses."""
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, model.args.vocab_size, (2, 17), generator=gen)
        loss = model(ids[:, :-1], ids[:, 1:], aux_grad_scale=1.0).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for router in model.routers():
            router.apply_bias_update(router.expert_load, rate=1e-2)
            router.expert_load.zero_()
        losses.append(loss.item())
    return losses


def trained_model(seed: int, args: ModelArgs | None = None,
                  moment_dtype: str = "fp32") -> tuple[DeepSeekV3, torch.optim.Optimizer]:
    """A model and the trainer's AdamW for `moment_dtype` (parallel.adamw), after two steps."""
    torch.manual_seed(seed)
    model = DeepSeekV3(args or ModelArgs())
    optimizer = make_adamw([{"params": list(model.parameters()), "weight_decay": 0.1}], moment_dtype, lr=1e-3)
    train(model, optimizer, 2, seed)
    return model, optimizer


def small_model(seed: int) -> tuple[nn.Module, torch.optim.AdamW]:
    """A two-layer MLP with AdamW state, for tests of file handling where the model does not matter."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 5)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def draws() -> tuple:
    return torch.rand(4).tolist(), np.random.rand(4).tolist(), random.random()


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    optim_state = optimizer.state_dict()
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {i: {k: v.clone() for k, v in s.items()} for i, s in optim_state["state"].items()})


def assert_same_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, expected: tuple[dict, dict]) -> None:
    model_state, optim_state = expected
    actual = model.state_dict()
    assert actual.keys() == model_state.keys()
    for name, tensor in model_state.items():
        assert torch.equal(actual[name], tensor), name
    if optimizer is not None:
        state = optimizer.state_dict()["state"]
        assert state.keys() == optim_state.keys()
        for index, values in optim_state.items():
            for key, tensor in values.items():
                assert torch.equal(state[index][key], tensor) and state[index][key].dtype == tensor.dtype, (index, key)


@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16"])
def test_round_trip_restores_model_optimizer_router_biases_extra_and_rng(tmp_path, seed, moment_dtype):
    """For both moment dtypes: training on from the loaded state gives the same losses and state bit for
    bit, and the moments are stored in their own dtype."""
    model, optimizer = trained_model(seed, moment_dtype=moment_dtype)
    with torch.no_grad():  # two sign updates may cancel out; make every bias non-trivial for sure
        for router in model.routers():
            router.e_score_correction_bias.add_(torch.rand(router.e_score_correction_bias.shape) - 0.5)
    seed_all(seed + 1)
    extra = {"step": 2, "consumed_samples": 4, "lr_schedule": {"last_step": 2}, "data_position": [seed, 7]}
    config_text = f"train:\n  seed: {seed}\n"
    path = save_checkpoint(tmp_path, 2, model, optimizer, extra, keep=2, text_files={"config.yaml": config_text})
    expected_draws = draws()
    expected_state = snapshot(model, optimizer)
    assert saved_moment_dtypes(path) == {MOMENT_DTYPES[moment_dtype]}

    restored, restored_optimizer = trained_model(seed + 2, moment_dtype=moment_dtype)
    assert not torch.equal(restored.embed_tokens.weight, model.embed_tokens.weight)
    assert load_checkpoint(path, restored, restored_optimizer) == extra
    assert draws() == expected_draws
    assert_same_state(restored, restored_optimizer, expected_state)
    assert restored_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert (path / "config.yaml").read_text() == config_text
    assert train(restored, restored_optimizer, 2, seed + 3) == train(model, optimizer, 2, seed + 3)
    assert_same_state(restored, restored_optimizer, snapshot(model, optimizer))


def test_keep_deletes_oldest_and_the_latest_file_names_the_last_save(tmp_path, seed):
    model, optimizer = small_model(seed)
    assert latest_iteration(tmp_path) is None
    for step in (10, 20, 30, 40):
        path = save_checkpoint(tmp_path, step, model, optimizer, {"step": step}, keep=2)
        assert path == tmp_path / f"iter_{step:07d}"
        assert int((tmp_path / LATEST_FILE).read_text()) == step == latest_iteration(tmp_path)
    assert list_iterations(tmp_path) == [30, 40]
    save_checkpoint(tmp_path, 41, model, optimizer, {"step": 41}, keep=1)
    assert list_iterations(tmp_path) == [41]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000041", LATEST_FILE]


def test_an_older_step_becomes_latest_and_newer_checkpoints_are_left_alone(tmp_path, seed):
    model, optimizer = small_model(seed)
    for step in (1, 2, 3, 7):
        save_checkpoint(tmp_path, step, model, optimizer, {"step": step}, keep=3)
    save_checkpoint(tmp_path, 4, model, optimizer, {"step": 4}, keep=2)
    assert latest_iteration(tmp_path) == 4
    assert list_iterations(tmp_path) == [3, 4, 7]


def test_saving_a_step_again_replaces_it_and_removes_leftovers_of_killed_saves(tmp_path, seed):
    model, optimizer = small_model(seed)
    save_checkpoint(tmp_path, 5, model, optimizer, {"step": 5, "version": 1}, keep=2)
    (tmp_path / "iter_0000006.tmp").mkdir()
    (tmp_path / "iter_0000006.tmp" / "__0_0.distcp").write_bytes(os.urandom(64))
    (tmp_path / (LATEST_FILE + ".tmp")).write_text("6\n")
    with torch.no_grad():
        model[0].weight.add_(torch.randn_like(model[0].weight))
    expected = snapshot(model, optimizer)
    save_checkpoint(tmp_path, 5, model, optimizer, {"step": 5, "version": 2}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000005", LATEST_FILE]
    fresh, fresh_optimizer = small_model(seed + 1)
    assert load_checkpoint(iteration_dir(tmp_path, 5), fresh, fresh_optimizer)["version"] == 2
    assert_same_state(fresh, fresh_optimizer, expected)


def test_the_ema_is_saved_under_its_own_prefix_loaded_in_place_and_a_missing_one_is_named(tmp_path, seed):
    model, optimizer = small_model(seed)
    gen = torch.Generator().manual_seed(seed)
    ema = {name: torch.randn(p.shape, generator=gen) for name, p in model.named_parameters()}
    with_ema = save_checkpoint(tmp_path / "a", 1, model, optimizer, {"step": 1}, keep=1, ema=ema)
    without = save_checkpoint(tmp_path / "b", 1, model, optimizer, {"step": 1}, keep=1)
    assert holds_ema(read_metadata(with_ema)) and not holds_ema(read_metadata(without))
    assert {k for k in read_metadata(with_ema).state_dict_metadata if k.startswith("ema.")} == {f"ema.{n}" for n in ema}
    fresh, fresh_optimizer = small_model(seed + 1)
    loaded = {name: torch.zeros_like(t) for name, t in ema.items()}
    load_checkpoint(with_ema, fresh, fresh_optimizer, ema=loaded)
    assert all(torch.equal(loaded[n], t) for n, t in ema.items())
    with pytest.raises(CheckpointError, match=r"missing in checkpoint: EMA: 0.weight \[7, 5\]"):
        load_checkpoint(without, fresh, fresh_optimizer, ema=loaded)


@pytest.mark.parametrize("content, message", [
    ("12abc\n", "expected an iteration number"),
    ("", "expected an iteration number"),
    ("9\n", "iter_0000009 does not exist"),
])
def test_a_bad_latest_file_is_an_error_naming_it(tmp_path, content, message):
    (tmp_path / LATEST_FILE).write_text(content)
    with pytest.raises(CheckpointError, match=message) as err:
        latest_iteration(tmp_path)
    assert LATEST_FILE in str(err.value)


def test_a_latest_file_pointing_to_an_incomplete_folder_is_an_error(tmp_path, seed):
    model, optimizer = small_model(seed)
    path = save_checkpoint(tmp_path, 3, model, optimizer, {}, keep=1)
    (path / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"iter_0000003, which is incomplete \(no .metadata\)"):
        latest_iteration(tmp_path)


def test_resolve_resume(tmp_path, seed):
    root = tmp_path / "ckpt"
    assert resolve_resume("auto", root) is None
    model, optimizer = small_model(seed)
    for step in (1, 2):
        save_checkpoint(root, step, model, optimizer, {}, keep=2)
    assert resolve_resume("auto", root) == iteration_dir(root, 2)
    assert resolve_resume("none", root) is None
    assert resolve_resume(str(iteration_dir(root, 1)), tmp_path / "elsewhere") == iteration_dir(root, 1)
    assert resolve_resume(str(root), tmp_path / "elsewhere") == iteration_dir(root, 2)
    with pytest.raises(CheckpointError, match="missing_run"):
        resolve_resume(str(tmp_path / "missing_run"), root)
    with pytest.raises(CheckpointError, match="neither a checkpoint folder"):
        resolve_resume(str(tmp_path), root)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, tuple[dict, dict]]:
    """A checkpoint of a trained default DeepSeekV3 and a snapshot of what it holds."""
    seed = random.SystemRandom().randrange(2**31)
    model, optimizer = trained_model(seed)
    path = save_checkpoint(tmp_path_factory.mktemp("ckpt"), 2, model, optimizer, {"step": 2}, keep=1)
    return path, snapshot(model, optimizer)


def test_weights_only_loads_the_model_alone(saved, seed):
    path, expected = saved
    model, optimizer = trained_model(seed)
    optimizer_before = snapshot(model, optimizer)[1]
    seed_all(seed)
    expected_draws = draws()
    seed_all(seed)
    assert load_checkpoint(path, model, optimizer, weights_only=True) == {}
    assert draws() == expected_draws
    assert_same_state(model, None, expected)
    assert_same_state(model, optimizer, (expected[0], optimizer_before))


@pytest.mark.parametrize("change, problems", [
    (dict(num_moe_experts=16, num_layers=5, mtp_num_layers=0), [
        "shape mismatch: layers.1.mlp.gate.e_score_correction_bias checkpoint [8] vs model [16]",
        "missing in checkpoint: layers.3.mlp.experts.down_proj.weight experts 8-15 [64, 32]",
        "missing in checkpoint: layers.4.mlp.gate.weight [16, 64]",
        "unexpected in checkpoint: mtp.0.eh_proj.weight [64, 128]",
    ]),
    (dict(hidden_size=96), [
        "shape mismatch: embed_tokens.weight checkpoint [1024, 64] vs model [1024, 96]",
        "shape mismatch: layers.0.self_attn.o_proj.weight checkpoint [64, 64] vs model [96, 64]",
    ]),
])
def test_a_model_shape_mismatch_names_every_tensor_and_changes_nothing(saved, seed, change, problems):
    path, _ = saved
    model, optimizer = trained_model(seed, ModelArgs(**change))
    before = snapshot(model, optimizer)
    with pytest.raises(CheckpointError, match="does not match the model") as err:
        load_checkpoint(path, model, optimizer)
    lines = str(err.value).splitlines()
    for problem in problems:
        assert any(line.strip() == problem for line in lines), problem
    assert_same_state(model, optimizer, before)


def _truncate_data_file(path: Path) -> str:
    data = path / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    return "__0_0.distcp is truncated"


def _remove_metadata(path: Path) -> str:
    (path / ".metadata").unlink()
    return "no .metadata file"


def _garble_metadata(path: Path) -> str:
    (path / ".metadata").write_bytes(os.urandom(256))
    return ".metadata is corrupt or not a checkpoint of this program ("


def _garble_extra(path: Path) -> str:
    (path / "extra.pt").write_bytes(os.urandom(256))
    return "extra.pt is corrupt or not a checkpoint of this program ("


def _garble_data_file(path: Path) -> str:
    """Garbage of the file's own size: the size check passes, reading it fails."""
    data = path / "__0_0.distcp"
    size = data.stat().st_size
    data.write_bytes(bytes(range(256)) * (size // 256) + bytes(size % 256))
    return "__0_0.distcp is corrupt or not a checkpoint of this program ("


@pytest.mark.parametrize("damage", [_truncate_data_file, _remove_metadata, _garble_metadata, _garble_extra,
                                    _garble_data_file])
def test_a_corrupt_checkpoint_is_an_error_naming_the_file(saved, tmp_path, seed, damage):
    path = tmp_path / "iter_0000002"
    shutil.copytree(saved[0], path)
    message = damage(path)
    model, optimizer = trained_model(seed)
    with pytest.raises(CheckpointError, match=str(path)) as err:
        load_checkpoint(path, model, optimizer)
    assert message in str(err.value) and "\n" not in str(err.value) and "weights_only" not in str(err.value)


def _read_step(proc: subprocess.Popen, stderr: Path, timeout: float) -> int:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    assert line, f"the writer printed no step:\n{stderr.read_text()}"
    return int(line)


def _assert_loads_as_written(path: Path, step: int, model: DeepSeekV3, optimizer: torch.optim.AdamW) -> None:
    assert load_checkpoint(path, model, optimizer, restore_rng=False) == {"step": step}
    for name, tensor in model.state_dict().items():
        assert torch.all(tensor == step), (path, name)
    for state in optimizer.state.values():
        assert torch.all(state["exp_avg"] == step) and torch.all(state["exp_avg_sq"] == step), path
    assert (path / "step.txt").read_text() == f"{step}\n"


def test_a_writer_killed_at_random_moments_always_leaves_a_loadable_latest_checkpoint(tmp_path, seed):
    """SIGKILL a process that saves in a loop, KILLS times; each restart resumes from the latest."""
    delays = random.Random(seed)
    root, stderr = tmp_path / "ckpt", tmp_path / "writer.err"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    model, optimizer = build(seed)
    for _ in range(KILLS):
        with open(stderr, "w") as err:
            proc = subprocess.Popen([sys.executable, "-m", "tests.unit._checkpoint_writer", str(root), "2"],
                                    cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            printed = [_read_step(proc, stderr, timeout=120)]
            time.sleep(delays.uniform(0.0, 0.4))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        printed += [int(line) for line in proc.stdout.read().split()]
        proc.stdout.close()
        latest = latest_iteration(root)
        assert printed[-1] <= latest <= printed[-1] + 1
        assert resolve_resume("auto", root) == iteration_dir(root, latest)
        for step in list_iterations(root):
            _assert_loads_as_written(iteration_dir(root, step), step, model, optimizer)


def _gloo_worker(rank: int, world: int, tmp: str, seed: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        model, optimizer = trained_model(seed)
        seed_all(seed + 1 + rank)
        path = save_checkpoint(Path(tmp) / "ckpt", 2, model, optimizer, {"step": 2}, keep=1)
        expected_draws = draws()
        expected = snapshot(model, optimizer)
        restored, restored_optimizer = trained_model(seed + 1)
        assert load_checkpoint(path, restored, restored_optimizer) == {"step": 2}
        assert draws() == expected_draws
        assert_same_state(restored, restored_optimizer, expected)
        torch.save(expected_draws, Path(tmp) / f"draws{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_save_and_load_one_checkpoint_with_rng_per_rank(tmp_path, seed):
    context = mp.start_processes(_gloo_worker, args=(2, str(tmp_path), seed), nprocs=2, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + 300
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the gloo workers did not finish")
    path = iteration_dir(tmp_path / "ckpt", 2)
    assert {p.name for p in path.glob("rng_rank*.pt")} == {"rng_rank0.pt", "rng_rank1.pt"}
    assert torch.load(tmp_path / "draws0.pt") != torch.load(tmp_path / "draws1.pt")


def gate_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold every DCP tensor write of this process until the returned event is set."""
    write_data, gate = dcp.FileSystemWriter.write_data, threading.Event()

    def gated(self: dcp.FileSystemWriter, *args):
        assert gate.wait(timeout=120), "the test never opened the gate"
        return write_data(self, *args)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", gated)
    return gate


def test_a_background_save_counts_once_published_and_holds_the_state_it_started_with(tmp_path, seed, monkeypatch):
    """While the write is held: no latest file, the folder under its temporary name, `poll` publishes
    nothing, and training changes the live tensors. Once written, `poll` publishes it (pruning with keep)
    and it loads as it was when the save started."""
    root = tmp_path / "ckpt"
    model, optimizer = build(seed)
    saves = BackgroundSaves()
    for step in (1, 2):
        gate = gate_writes(monkeypatch)
        fill(model, optimizer, float(step))
        assert saves.start(root, step, model, optimizer, {"step": step}, keep=1,
                           text_files={"step.txt": f"{step}\n"}) == iteration_dir(root, step)
        fill(model, optimizer, 100.0 + step)  # training goes on
        assert saves.poll() is None and latest_iteration(root) == (None if step == 1 else step - 1)
        assert (root / f"iter_{step:07d}.tmp").is_dir() and list_iterations(root) == ([] if step == 1 else [step - 1])
        gate.set()
        deadline = time.monotonic() + 120
        while (published := saves.poll()) is None:
            assert time.monotonic() < deadline, "the background write never finished"
            time.sleep(0.01)
        assert published == iteration_dir(root, step)
        assert latest_iteration(root) == step and list_iterations(root) == [step]
        _assert_loads_as_written(published, step, *build(seed))
    saves.close()


def _read_line(proc: subprocess.Popen, stderr: Path, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    assert line, f"the writer printed nothing:\n{stderr.read_text()}"
    return line.strip()


def test_a_kill_during_a_background_write_leaves_the_previous_checkpoint_loadable_and_resumable(tmp_path, seed):
    """SIGKILL the async writer (tensor writes slowed down) while it writes step 2: 1 stays the latest and
    loads as written. A restart resumes from 1 and is killed while writing step 3: step 2 is the latest and
    holds step 2's values, although the model was refilled with 3 while step 2 was written."""
    root, stderr = tmp_path / "ckpt", tmp_path / "writer.err"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    model, optimizer = build(seed)
    delays = random.Random(seed)
    for writing in (2, 3):
        with open(stderr, "w") as err:
            proc = subprocess.Popen([sys.executable, "-m", "tests.unit._checkpoint_writer", str(root), "2", "async"],
                                    cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            lines = [_read_line(proc, stderr, timeout=120)]
            while lines[-1] != f"writing {writing}":
                lines.append(_read_line(proc, stderr, timeout=120))
            time.sleep(delays.uniform(0.0, 0.5))  # inside the 1 s delay of the tensor write
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
        assert lines[-2:] == [f"published {writing - 1}", f"writing {writing}"], lines
        assert latest_iteration(root) == writing - 1, lines
        assert (root / f"iter_{writing:07d}.tmp").is_dir() and not iteration_dir(root, writing).exists()
        assert resolve_resume("auto", root) == iteration_dir(root, writing - 1)
        for step in list_iterations(root):
            _assert_loads_as_written(iteration_dir(root, step), step, model, optimizer)
