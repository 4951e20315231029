"""End-to-end training runs on the tiny config: metrics, exact resume after SIGKILL, signals,
NaN handling, bad input, the launcher and the plot script."""
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from benchmarks.bf16_loss_curves import curve_difference, loss_curve, main as bf16_curves_main, nudge_one_weight, \
    train_run
from benchmarks.bf16_moments_curves import moment_curves
from moe_train.checkpoint.dcp import iteration_dir, latest_iteration, list_iterations
from moe_train.config import ConfigError, load_config
from moe_train.train import EXIT_DIVERGED, Trainer, TrainingDiverged, main, read_metrics
from tests.unit._checkpoint_writer import slowed_write

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "moe_train/configs/tiny.yaml")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("corpus_cache"))


def overrides(run_dir, cache_dir, *extra):
    return ["--set", f"logging.dir={run_dir}", "--set", f"data.cache_dir={cache_dir}",
            "--set", "data.demo_max_bytes=400000", "--set", "train.threads=1",
            "--set", "logging.tensorboard=false", *[a for kv in extra for a in ("--set", kv)]]


def records(run_dir):
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_cli(args, **kwargs):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "moe_train.train", "--config", TINY, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_tiny_trains_logs_every_figure_and_checkpoints(tmp_path, cache_dir, capsys):
    run = tmp_path / "run"
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=6", "train.log_interval=2",
                                              "train.eval_interval=3", "checkpoint.interval=3")]) == 0
    logged = records(run)
    assert [r["step"] for r in logged] == [2, 3, 4, 6]
    for key in ("loss", "lm_loss", "mtp_loss", "aux_loss", "lr", "grad_norm", "tokens_per_s",
                "expert_load_max_over_mean"):
        assert all(isinstance(r[key], float) for r in logged), key
    assert "valid_loss" in logged[1] and "valid_loss" in logged[3]
    assert not any(key.startswith("ranks/") for r in logged for key in r)  # one process: no straggler exchange
    assert logged[-1]["loss"] < logged[0]["loss"]
    # peak resident memory (this process's, since it started): it never falls, and it is at least what
    # the process holds now
    peaks = [r["mem_rss_peak_gib"] for r in logged]
    assert peaks == sorted(peaks) and peaks[-1] >= current_rss_gib() > 0
    assert latest_iteration(run / "checkpoints") == 6
    assert sorted(p.name for p in (run / "checkpoints").glob("iter_*")) == ["iter_0000003", "iter_0000006"]
    assert load_config(run / "config.yaml").train.steps == 6
    out = capsys.readouterr().out
    assert "step 6/6" in out and "tok/s" in out and "ETA" in out and f"rss {peaks[-1]:.2f} GiB" in out
    assert "straggler" not in out


def current_rss_gib() -> float:
    """This process's resident set size now, from /proc/self/statm (pages)."""
    import os
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def test_sigkill_then_resume_gives_bit_identical_losses(tmp_path, cache_dir):
    common = ("train.steps=30", "train.log_interval=1", "checkpoint.interval=2")
    straight = tmp_path / "straight"
    assert main(["--config", TINY, *overrides(straight, cache_dir, *common)]) == 0
    expected = {r["step"]: r["loss"] for r in records(straight)}

    killed = tmp_path / "killed"
    proc = run_cli(overrides(killed, cache_dir, *common))
    deadline = time.time() + 120
    while time.time() < deadline and not any(r["step"] >= 5 for r in records(killed)):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed_from = latest_iteration(killed / "checkpoints")
    assert resumed_from is not None and 4 <= resumed_from < 30
    assert main(["--config", TINY, *overrides(killed, cache_dir, *common)]) == 0
    after = {r["step"]: r["loss"] for r in records(killed) if r["step"] > resumed_from}
    assert sorted(after) == list(range(resumed_from + 1, 31))
    assert all(after[s] == expected[s] for s in after), (after, expected)


def test_async_saves_train_as_sync_saves_and_resume_bit_exactly(tmp_path, cache_dir, monkeypatch):
    """checkpoint.async_save with every tensor write 0.5 s late, so that the next steps change the live
    tensors while a save is written: the losses equal a run with synchronous saves, and resuming from the
    first background checkpoint (written while step 3 trained) gives steps 3 to 6 bit for bit."""
    common = ("train.steps=6", "train.log_interval=1", "checkpoint.interval=2", "checkpoint.keep=3")
    synchronous = tmp_path / "sync"
    assert main(["--config", TINY, *overrides(synchronous, cache_dir, *common)]) == 0
    expected = {r["step"]: r["loss"] for r in records(synchronous)}
    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", slowed_write(0.5))
    background = tmp_path / "async"
    assert main(["--config", TINY, *overrides(background, cache_dir, *common, "checkpoint.async_save=true")]) == 0
    assert {r["step"]: r["loss"] for r in records(background)} == expected
    saved = background / "checkpoints"
    assert latest_iteration(saved) == 6 and list_iterations(saved) == [2, 4, 6] and not list(saved.glob("*.tmp"))
    resumed = tmp_path / "resumed"
    at_2 = f"checkpoint.resume={iteration_dir(background / 'checkpoints', 2)}"
    assert main(["--config", TINY, *overrides(resumed, cache_dir, *common, at_2)]) == 0
    assert {r["step"]: r["loss"] for r in records(resumed)} == {s: expected[s] for s in range(3, 7)}


def test_bf16_moments_resume_bit_exact_and_a_changed_moment_dtype_is_converted(tmp_path, cache_dir, capsys):
    """Resumed at step 2 of a 4-step run with bf16 moments, steps 3 and 4 give the same losses bit for
    bit. Resumed with optim.moment_dtype=fp32 instead, the moments are the checkpoint's bf16 values
    exactly, in fp32, and one line says so."""
    common = ("train.steps=4", "train.log_interval=1", "checkpoint.interval=2", "optim.moment_dtype=bf16")
    straight = tmp_path / "straight"
    assert main(["--config", TINY, *overrides(straight, cache_dir, *common)]) == 0
    expected = {r["step"]: r["loss"] for r in records(straight)}
    at_2 = f"checkpoint.resume={iteration_dir(straight / 'checkpoints', 2)}"
    resumed = tmp_path / "resumed"
    capsys.readouterr()
    assert main(["--config", TINY, *overrides(resumed, cache_dir, *common, at_2)]) == 0
    assert {r["step"]: r["loss"] for r in records(resumed)} == {3: expected[3], 4: expected[4]}
    assert "converted" not in capsys.readouterr().out

    def loaded(moment_dtype):
        trainer = Trainer(load_config(TINY, overrides(tmp_path / moment_dtype, cache_dir, *common, at_2,
                                                      f"optim.moment_dtype={moment_dtype}")[1::2]))
        return [v for s in trainer.optimizer.state.values() for k, v in sorted(s.items()) if k != "step"]

    bf16 = loaded("bf16")
    capsys.readouterr()
    fp32 = loaded("fp32")
    assert "resume: Adam moments converted from bf16 (the checkpoint's) to fp32 (optim.moment_dtype)" in \
        capsys.readouterr().out
    assert {t.dtype for t in bf16} == {torch.bfloat16} and {t.dtype for t in fp32} == {torch.float32}
    assert all(torch.equal(a.float(), b) for a, b in zip(bf16, fp32, strict=True))
    assert any(t.abs().max() > 0 for t in fp32)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_saves_and_exits_cleanly(tmp_path, cache_dir, signum):
    """SIGTERM, and Ctrl-C (was: a KeyboardInterrupt traceback, no save), on a single-process run."""
    run = tmp_path / "run"
    proc = run_cli(overrides(run, cache_dir, "train.steps=100000", "train.log_interval=1"))
    deadline = time.time() + 120
    while time.time() < deadline and not records(run):
        time.sleep(0.05)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err, err
    step = latest_iteration(run / "checkpoints")
    name = signal.Signals(signum).name
    assert step >= 1 and f"received {name}: saved {run / 'checkpoints' / f'iter_{step:07d}'}, exiting" in out
    assert records(run)[-1]["step"] == step


def _snapshot(trainer):
    """Every weight, buffer (router biases) and optimizer state tensor, cloned."""
    state = {f"model.{k}": v.clone() for k, v in trainer.model.state_dict().items()}
    for index, per_param in enumerate(trainer.optimizer.state.values()):
        state.update({f"optim.{index}.{k}": v.clone() for k, v in per_param.items() if isinstance(v, torch.Tensor)})
    return state


@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16"])
def test_non_finite_gradient_skips_the_step_on_the_device(tmp_path, cache_dir, moment_dtype):
    """The NaN step changes no weight, router bias, Adam moment or step count; the next step trains on."""
    run = tmp_path / "run"
    trainer = Trainer(load_config(TINY, overrides(run, cache_dir, "train.steps=5",
                                                  f"optim.moment_dtype={moment_dtype}")[1::2]))
    trainer.train_step()
    before = _snapshot(trainer)
    hook = trainer.model.lm_head.weight.register_hook(lambda grad: grad * float("nan"))
    skipped_step = trainer.train_step()
    hook.remove()
    after = _snapshot(trainer)
    assert after.keys() == before.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == [], changed
    next_step = trainer.train_step()
    [skipped, trained] = read_metrics([skipped_step, next_step])
    assert skipped["skipped"] == 1.0 and math.isnan(skipped["grad_norm"])
    assert trained["skipped"] == 0.0 and math.isfinite(trained["grad_norm"])
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert {float(s["step"]) for s in trainer.optimizer.state.values()} == {2.0}  # 3 steps, 1 skipped
    assert not torch.equal(trainer.model.lm_head.weight, after["model.lm_head.weight"])


def test_consecutive_skips_stop_with_exit_3_naming_step_part_and_kept_checkpoint(tmp_path, cache_dir, capsys):
    run = tmp_path / "run"
    trainer = Trainer(load_config(TINY, overrides(run, cache_dir, "train.steps=8", "checkpoint.interval=2",
                                                  "train.log_interval=1", "train.max_skipped_steps=3")[1::2]))
    trainer.train_step()
    trainer.train_step()
    trainer.save()
    good = _snapshot(trainer)
    trainer.model.lm_head.register_forward_hook(lambda module, inputs, output: output * float("nan"))
    assert trainer.train() == EXIT_DIVERGED
    out = capsys.readouterr().out
    assert "step 3: non-finite lm loss (nan): step skipped, no update (1 in a row, train.max_skipped_steps=3)" in out
    assert "step 4: non-finite lm loss (nan): step skipped" in out
    assert (f"step 5: non-finite lm loss (nan); 3 consecutive steps skipped (train.max_skipped_steps=3), stopping; "
            f"the last good checkpoint is kept: {run / 'checkpoints' / 'iter_0000004'}") in out
    assert latest_iteration(run / "checkpoints") == 4  # steps 3 and 4 skipped: the weights of step 2
    skipped_steps = [r["skipped_steps"] for r in records(run)]
    assert skipped_steps == [1, 1], skipped_steps  # the log lines of steps 3 and 4
    reloaded = Trainer(load_config(TINY, overrides(tmp_path / "reload", cache_dir, "train.steps=8",
                                                   f"checkpoint.resume={run / 'checkpoints'}")[1::2]))
    assert reloaded.step == 4
    weights = [f"model.{name}" for name, _ in reloaded.model.named_parameters()]
    weights += [k for k in good if k.endswith("e_score_correction_bias")]
    assert len(weights) > 50 and all(torch.equal(_snapshot(reloaded)[k], good[k]) for k in weights)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_save_refuses_non_finite_weights(tmp_path, cache_dir, async_save):
    """Also with checkpoint.async_save: the check comes before the save starts (no folder of step 2, not
    even a temporary one), after the save in flight is published."""
    run = tmp_path / "run"
    trainer = Trainer(load_config(TINY, overrides(run, cache_dir, "train.steps=5",
                                                  f"checkpoint.async_save={str(async_save).lower()}")[1::2]))
    trainer.train_step()
    trainer.save()
    trainer.train_step()
    trainer.model.norm.weight.data[0] = float("inf")
    with pytest.raises(TrainingDiverged, match="step 2: non-finite weights, optimizer state or EMA, not saving them; "
                                               "the last good checkpoint is kept: .*iter_0000001"):
        trainer.save()
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("iter_")) == ["iter_0000001"]
    assert latest_iteration(run / "checkpoints") == 1
    if trainer.background_saves is not None:
        trainer.background_saves.close()


def test_huge_learning_rate_stops_with_exit_3_and_every_checkpoint_is_finite(tmp_path, cache_dir, capsys):
    """The probe's case: optim.lr=1e30 once applied a NaN-gradient step and saved it."""
    run = tmp_path / "run"
    code = main(["--config", TINY, *overrides(run, cache_dir, "train.steps=10", "checkpoint.interval=1",
                                              "checkpoint.keep=10", "optim.lr=1e30", "train.log_interval=1")])
    out = capsys.readouterr().out
    assert code == EXIT_DIVERGED, out
    assert "consecutive steps skipped" in out or "non-finite weights" in out
    steps = list_iterations(run / "checkpoints")
    print(f"checkpoints kept: {steps}")
    for step in steps:
        trainer = Trainer(load_config(TINY, overrides(tmp_path / f"load{step}", cache_dir, "train.steps=10",
                                                      f"checkpoint.resume={iteration_dir(run / 'checkpoints', step)}")[1::2]))
        assert trainer.step == step and trainer.state_is_finite(), step


def test_bad_config_exits_2_without_traceback(tmp_path, cache_dir):
    proc = run_cli(overrides(tmp_path, cache_dir, "model.moe_router_group_topk=9"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "model.moe_router_group_topk" in err and "Traceback" not in err


def test_resume_with_other_model_shape_names_tensors(tmp_path, cache_dir, capsys):
    run = tmp_path / "run"
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=1")]) == 0
    code = main(["--config", TINY, *overrides(run, cache_dir, "train.steps=2", "model.moe_ffn_hidden_size=48")])
    err = capsys.readouterr().err
    assert code == 2 and "experts.gate_up_proj.weight" in err


def test_weights_only_resume_restarts_the_step_count(tmp_path, cache_dir):
    source = tmp_path / "source"
    assert main(["--config", TINY, *overrides(source, cache_dir, "train.steps=2")]) == 0
    run = tmp_path / "finetune"
    trainer = Trainer(load_config(TINY, overrides(run, cache_dir, "train.steps=2", "checkpoint.weights_only=true",
                                                  f"checkpoint.resume={source / 'checkpoints'}")[1::2]))
    assert trainer.step == 0
    first = next(iter(trainer.model.state_dict().values()))
    again = Trainer(load_config(TINY, overrides(source, cache_dir, "train.steps=2")[1::2]))
    assert (first == next(iter(again.model.state_dict().values()))).all()


def test_launcher_and_plot(tmp_path, cache_dir):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NPROC_PER_NODE": "1", "PYTHON": sys.executable}
    env.pop("SLURM_JOB_ID", None)
    result = subprocess.run(["bash", "scripts/pretrain_dsv3.sh", TINY, *overrides(run, cache_dir, "train.steps=3")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert [r["step"] for r in records(run)][-1] == 3
    bad = subprocess.run(["bash", "scripts/pretrain_dsv3.sh", TINY, "--set", "train.stepz=3"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "did you mean 'steps'" in bad.stderr
    plot = subprocess.run([sys.executable, "scripts/plot_metrics.py", str(run / "metrics.jsonl")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr
    png = run / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_bf16_training_on_cpu(tmp_path, cache_dir):
    run = tmp_path / "run"
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=3", "train.log_interval=1",
                                              "train.precision=bf16")]) == 0
    losses = [r["loss"] for r in records(run)]
    assert len(losses) == 3 and all(0 < loss < 20 for loss in losses)


def test_bf16_loss_curve_follows_fp32(cache_dir):
    """The same run (seed, data, initialisation) in bf16 and fp32: the curves agree to bf16
    noise (measured on the tiny config: max 0.012, mean 0.006 over 20 steps with bf16 parameters;
    the former bf16 autocast: max 0.050, mean 0.025) and both fall."""
    settings = [f"data.cache_dir={cache_dir}", "data.demo_max_bytes=400000", "train.threads=1"]
    curves = {p: loss_curve(TINY, p, 20, settings) for p in ("fp32", "bf16")}
    print(f"seed {load_config(TINY).train.seed}")
    worst, mean = curve_difference(curves["bf16"], curves["fp32"])
    print(f"|bf16 - fp32|: max {worst:.4f}, mean {mean:.4f}")
    assert curves["bf16"][0] == pytest.approx(curves["fp32"][0], abs=1e-3)  # same model and batch
    assert worst < 0.025 and mean < 0.012
    assert all(curve[-1] < curve[0] - 2 for curve in curves.values())


def test_the_one_ulp_nudge_moves_one_weight_by_one_ulp_and_the_curve_after_it(cache_dir, tmp_path):
    """benchmarks/bf16_loss_curves --nudge: in bf16 the nudged element is the next bf16 number up, its
    fp32 main value the same number, every other weight unchanged; the first loss moves by at most
    rounding, and the curve moves after it (the noise floor the README reports for curve comparisons)."""
    settings = [f"data.cache_dir={cache_dir}", "data.demo_max_bytes=400000", "train.threads=1"]
    config = load_config(TINY, ["train.precision=bf16", f"logging.dir={tmp_path}", "logging.tensorboard=false",
                                *settings])
    trainer = Trainer(config)
    try:
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        nudge_one_weight(trainer)
        name, param = next((n, p) for n, p in trainer.model.named_parameters() if n.endswith("o_proj.weight"))
        old, new = before[name].view(-1)[0], param.detach().view(-1)[0]
        next_up = (old.view(torch.int16) + (1 if old > 0 else -1)).view(torch.bfloat16)  # the bit pattern's neighbour
        assert old > 0 and new == next_up and param.main_piece.main[0] == new.float()
        assert torch.equal(param.detach().view(-1)[1:], before[name].view(-1)[1:])
        assert all(torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters() if n != name)
    finally:
        trainer.logger.close()
    base = loss_curve(TINY, "bf16", 3, settings)
    nudged = train_run(TINY, "bf16", 3, settings, prepare=nudge_one_weight).losses
    print(f"bf16 {base}, nudged {nudged}")
    assert nudged[0] == pytest.approx(base[0], abs=1e-3) and nudged != base


def test_bf16_curves_compare_each_seed(cache_dir, capsys):
    """benchmarks/bf16_loss_curves --seeds: one comparison per train.seed (other initialisations, so other
    first losses), then each seed's max and mean together."""
    settings = [f"--set=data.cache_dir={cache_dir}", "--set=data.demo_max_bytes=400000", "--set=train.threads=1"]
    bf16_curves_main(["--config", TINY, "--steps", "2", "--seeds", "3", "4", *settings])
    out = capsys.readouterr().out
    print(out)
    firsts = [float(m) for m in re.findall(r"step    1  fp32 ([0-9.]+)", out)]
    assert "seed 3" in out and "seed 4" in out and len(firsts) == 2 and firsts[0] != firsts[1]
    assert re.search(r"\|bf16 - fp32\| over seeds 3 4: max per seed [0-9.]+ [0-9.]+; mean per seed [0-9.]+ [0-9.]+",
                     out)


def test_bf16_moments_loss_curve_follows_fp32_moments(cache_dir):
    """benchmarks/bf16_moments_curves on 4 tiny steps: the first losses are equal (no update yet), the
    later ones differ (the moments' rounding reaches the weights) by bf16 noise only."""
    settings = [f"data.cache_dir={cache_dir}", "data.demo_max_bytes=400000", "train.threads=1"]
    curves = moment_curves(TINY, 4, settings)
    print(f"seed {load_config(TINY).train.seed}")
    worst, mean = curve_difference(curves["bf16"], curves["fp32"])
    print(f"|bf16 - fp32 moments|: max {worst:.2e}, mean {mean:.2e}")
    assert curves["bf16"][0] == curves["fp32"][0]
    assert 0 < worst < 1e-3


LAUNCHER_REFUSALS = {
    # dualpipev on pp 2 needs 4 micro-batches; the tiny config's batch on dp 2 gives 1
    "pipeline-split": (["parallel.pp=2", "parallel.schedule=dualpipev"],
                       "parallel: schedule dualpipev on pp=2 with 1 micro-batches"),
    "cuda-without-gpu": (["train.micro_batch_size=2", "train.device=cuda"], "train.device: cuda, but CUDA is not available"),
    "cannot-fit": (["train.micro_batch_size=2", "model.hidden_size=1000000"], "memory: cpu memory: each process needs at least"),
    "too-many-threads": (["train.micro_batch_size=2", "train.threads=8192"], "train.threads: 8192 exceeds the"),
    "data-missing": (["train.micro_batch_size=2", "data.path=/nonexistent/prefix"],
                     "data.path: dataset file not found: /nonexistent/prefix.idx, /nonexistent/prefix.bin"),
    "resume-missing": (["train.micro_batch_size=2", "checkpoint.resume=/nonexistent"],
                       "checkpoint.resume: /nonexistent does not exist"),
    "tokenizer-missing": (["train.micro_batch_size=2", "data.tokenizer=/nonexistent.json"],
                          "data.tokenizer: /nonexistent.json is not a file"),
    "deepep-missing": (["train.micro_batch_size=2", "parallel.dispatcher=deepep"], "parallel.dispatcher: 'deepep' cannot run here"),
}


@pytest.mark.parametrize("case", LAUNCHER_REFUSALS)
def test_launcher_refuses_what_the_trainer_would_before_starting_any_process(tmp_path, case):
    """What every worker would refuse at start-up (the trainer's own checks) is said once by the launcher,
    exit 2, and no worker, torchrun line or run directory is ever made. Before the launcher ran these
    checks, each case printed its line once per worker (4 times), then a torchrun traceback, exit 1."""
    overrides, message = LAUNCHER_REFUSALS[case]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NPROC_PER_NODE": "4", "PYTHON": sys.executable}
    env.pop("SLURM_JOB_ID", None)
    args = [x for o in ["parallel.ep=2", *overrides, f"logging.dir={tmp_path / 'run'}"] for x in ("--set", o)]
    bad = subprocess.run(["bash", "scripts/pretrain_dsv3.sh", TINY, *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    lines = bad.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: 1 node(s) x 4 process(es): ") and message in lines[0], \
        bad.stderr
    assert not bad.stdout and not (tmp_path / "run").exists()


@pytest.mark.parametrize("nproc, args, message", [
    ("-2", [], "error: NPROC_PER_NODE: must be a whole number >= 1, got '-2'"),
    ("0", [], "error: NPROC_PER_NODE: must be a whole number >= 1, got '0'"),  # ran one process
    ("abc", [], "error: NPROC_PER_NODE: must be a whole number >= 1, got 'abc'"),
    ("1", ["--bogus"], "error: arguments: unknown '--bogus': the launcher takes [CONFIG] [--set"),
], ids=["negative", "zero", "not-a-number", "unknown-argument"])
def test_launcher_arguments_that_make_no_sense_are_named(tmp_path, nproc, args, message):
    """Were: an AssertionError traceback (-2), one process started (0), and the usage of the internal
    launch_info tool with options the user never typed (abc, --bogus)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NPROC_PER_NODE": nproc, "PYTHON": sys.executable}
    env.pop("SLURM_JOB_ID", None)
    bad = subprocess.run(["bash", "scripts/pretrain_dsv3.sh", TINY, *args, "--set", f"logging.dir={tmp_path / 'run'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.splitlines() == [bad.stderr.strip()], bad.stderr
    assert bad.stderr.startswith(message) and not (tmp_path / "run").exists(), bad.stderr


@pytest.mark.parametrize("overrides", [["model.num_layers=100000"], ["model.hidden_size=1000000"],
                                       ["train.micro_batch_size=65536", "train.global_batch_size=65536"],
                                       ["train.global_batch_size=1000000000000"]],
                         ids=["layers", "width", "batch", "step-batch"])
def test_a_run_that_cannot_fit_stops_before_allocating(tmp_path, capsys, overrides):
    code = main(["--config", TINY, "--set", f"logging.dir={tmp_path / 'run'}", *(x for o in overrides for x in ("--set", o))])
    err = capsys.readouterr().err
    assert code == 2 and "error: memory: cpu memory: each process needs at least" in err, err
    assert not (tmp_path / "run").exists()  # refused before any work: no run directory, no model


def test_profile_steps_write_a_chrome_trace_of_those_steps_only(tmp_path, cache_dir, capsys):
    """logging.profile_steps=[2,3] on a 4-step run: rank 0 writes one Chrome trace holding the `step 2`
    and `step 3` ranges and the ops run in them, and no other step; a reversed range is refused."""
    run = tmp_path / "run"
    assert main(["--config", TINY, *overrides(run, cache_dir, "train.steps=4", "logging.profile_steps=[2,3]")]) == 0
    trace = run / "profile" / "rank0_steps2-3.json"
    events = json.loads(trace.read_text())["traceEvents"]
    steps = sorted({e["name"] for e in events if e.get("name", "").startswith("step ")})
    assert steps == ["step 2", "step 3"]
    assert any(e.get("name", "").startswith("aten::mm") for e in events)
    assert sorted(p.name for p in (run / "profile").iterdir()) == [trace.name]
    assert f"profile of steps 2-3 written to {trace}" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="logging.profile_steps"):
        load_config(TINY, ["logging.profile_steps=[3,2]"])
    with pytest.raises(ConfigError, match="logging.profile_ranks"):
        load_config(TINY, ["logging.profile_ranks=[0,-1]"])
