"""The EMA of the parameters (optim.ema_decay, moe_train.ema) on the tiny config, one process: the
float64 recurrence over the parameters after each step (a skipped step included), bit-exact resume
after a stop-signal save, a checkpoint without an EMA, the HF export of the EMA, and the background
thread ending on success, stop and error. The distributed layouts are in
tests/distributed/test_training.py (the layout-changing resume)."""
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from moe_train.checkpoint.hf import load_hf_checkpoint, main as hf_cli
from moe_train.checkpoint.dcp import iteration_dir, quiet_dcp
from moe_train.config import load_config
from moe_train.ema import EMAError
from moe_train.train import Trainer, read_metrics
from parallel.sharded_state import model_state

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "moe_train/configs/tiny.yaml"
UNIT_ROUNDOFF = 2.0**-24


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("corpus_cache"))


@pytest.fixture
def seed() -> int:
    value = random.SystemRandom().randrange(2**31)
    print(f"seed={value}")
    return value


def decay_of(seed: int) -> float:
    decay = random.Random(seed).uniform(0.5, 0.95)
    print(f"ema_decay={decay}")
    return decay


def trainer(run: Path, cache_dir: str, seed: int, *extra: str) -> Trainer:
    return Trainer(load_config(TINY, [
        f"logging.dir={run}", f"data.cache_dir={cache_dir}", "data.demo_max_bytes=300000", "train.threads=1",
        "logging.tensorboard=false", "train.steps=4", "train.log_interval=1", f"train.seed={seed}", *extra]))


def parameters(t: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().double().clone() for name, p in t.model.named_parameters()}


def ema_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("ema") and t.is_alive()}


def test_the_ema_is_the_float64_recurrence_over_the_parameters_after_each_step(tmp_path, cache_dir, seed):
    """ema_N = d ema_{N-1} + (1 - d) p_N from ema_0 = p_0, over the parameters recorded after each of 5 steps,
    the third skipped (NaN gradient: the parameters stay, the update folds them in again). Bound: each fp32
    update rounds d, 1 - d, the two products and the sum (about 3 u max|p|, u = 2^-24), and earlier errors
    shrink by d, so |ema - reference| <= 4 N u max|p|."""
    decay = decay_of(seed)
    t = trainer(tmp_path / "run", cache_dir, seed, f"optim.ema_decay={decay}")
    recorded = [parameters(t)]
    metrics = []
    for step in range(5):
        hook = t.model.lm_head.weight.register_hook(lambda grad: grad * float("nan")) if step == 2 else None
        metrics.append(t.train_step())
        if hook is not None:
            hook.remove()
        recorded.append(parameters(t))
    assert [m["skipped"] for m in read_metrics(metrics)] == [0.0, 0.0, 1.0, 0.0, 0.0]
    reference = recorded[0]
    for params in recorded[1:]:
        reference = {name: decay * reference[name] + (1 - decay) * params[name] for name in params}
    t.ema.wait()
    assert t.ema.average.keys() == reference.keys()
    scale = max(p.abs().max().item() for params in recorded for p in params.values())
    bound = 4 * 5 * UNIT_ROUNDOFF * scale
    worst = max((t.ema.average[name].double() - reference[name].flatten()).abs().max().item() for name in reference)
    lag = max((t.ema.average[name].double() - recorded[-1][name].flatten()).abs().max().item() for name in reference)
    print(f"max |ema - float64 reference| = {worst:.3g} (bound {bound:.3g}); the EMA lags the weights by {lag:.3g}")
    assert worst <= bound
    assert lag > 100 * bound  # the weights moved: an EMA equal to them would fail
    assert all(a.device.type == "cpu" and a.dtype == torch.float32 for a in t.ema.average.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_stop_signal_save_and_resume_continue_the_ema_bit_for_bit(tmp_path, cache_dir, seed, precision):
    """bf16: the EMA averages the fp32 main parameters, which the checkpoint holds, so it continues exactly too."""
    decay = (f"optim.ema_decay={decay_of(seed)}", f"train.precision={precision}")
    straight = trainer(tmp_path / "straight", cache_dir, seed, *decay)
    assert straight.train() == 0 and straight.step == 4
    stopped = trainer(tmp_path / "run", cache_dir, seed, *decay)
    stopped.stop.note(signal.SIGTERM)
    before = ema_threads()
    assert stopped.train() == 0 and stopped.step == 1  # saved step 1 and ended its thread
    assert ema_threads() <= before
    resumed = trainer(tmp_path / "run", cache_dir, seed, *decay)
    assert resumed.step == 1
    assert all(torch.equal(resumed.ema.average[n], a) for n, a in stopped.ema.average.items())
    assert resumed.train() == 0 and ema_threads() <= before
    assert all(torch.equal(resumed.ema.average[n], a) for n, a in straight.ema.average.items())
    assert not all(torch.equal(p.detach().flatten(), straight.ema.average[n]) for n, p in straight.model.named_parameters())


def test_a_checkpoint_without_an_ema_starts_it_from_its_weights_and_export_writes_the_ema(tmp_path, cache_dir, seed,
                                                                                          capsys, monkeypatch):
    run, decay = tmp_path / "run", f"optim.ema_decay={decay_of(seed)}"
    plain = trainer(run, cache_dir, seed)
    plain.train_step()
    plain.train_step()
    plain.save()
    capsys.readouterr()
    t = trainer(run, cache_dir, seed, decay)
    path = iteration_dir(run / "checkpoints", 2)
    lines = [line for line in capsys.readouterr().out.splitlines() if "EMA" in line]
    assert lines == [f"optim.ema_decay: no EMA loaded from {path} (the checkpoint holds none); "
                     "the EMA starts from its weights"]
    assert t.step == 2
    assert all(torch.equal(t.ema.average[n], p.detach().flatten()) for n, p in plain.model.named_parameters())
    fold = t.ema._fold
    monkeypatch.setattr(t.ema, "_fold", lambda copied: (time.sleep(1), fold(copied)))  # a slow update in flight
    t.train_step()
    saved = t.save()
    in_checkpoint = {"ema": {key: torch.empty(v.shape, dtype=v.dtype) for key, v in t.ema_state().items()}}
    quiet_dcp(dcp.load, in_checkpoint, storage_reader=dcp.FileSystemReader(saved))
    t.ema.wait()
    assert all(torch.equal(in_checkpoint["ema"][k].flatten(), v.values)  # one process owns every whole tensor
               for k, v in t.ema_state().items())  # the save waited for it

    assert hf_cli(["export", "--ema", str(run / "checkpoints"), str(tmp_path / "hf")]) == 0
    exported = model_state(load_hf_checkpoint(tmp_path / "hf"))
    ema = in_checkpoint["ema"]
    buffers = {n: b for n, b in model_state(t.model).items() if n not in ema}
    assert exported.keys() == ema.keys() | buffers.keys() and len(buffers) == len(t.model.routers())
    assert all(torch.equal(exported[n], e) for n, e in ema.items())
    assert all(torch.equal(exported[n], b) for n, b in buffers.items())  # router biases as saved
    assert not all(torch.equal(exported[n], w) for n, w in model_state(t.model).items())  # not the weights

    capsys.readouterr()
    assert hf_cli(["export", "--ema", str(path), str(tmp_path / "hf2")]) == 2
    assert capsys.readouterr().out == (f"error: {path} holds no EMA (trained without optim.ema_decay); "
                                       "export it without --ema\n")
    assert not (tmp_path / "hf2").exists()


def test_an_error_of_the_background_update_is_raised_naming_the_ema_and_its_thread_ends(tmp_path, cache_dir, seed,
                                                                                         monkeypatch):
    t = trainer(tmp_path / "run", cache_dir, seed, f"optim.ema_decay={decay_of(seed)}")

    def broken(copied):
        raise ValueError("planted")

    monkeypatch.setattr(t.ema, "_fold", broken)
    before = ema_threads()
    with pytest.raises(EMAError, match=r"^optim.ema_decay: the background EMA update failed: ValueError: planted$"):
        t.train()
    assert t.step == 1  # raised at step 2's update, which waits for step 1's
    assert ema_threads() <= before
