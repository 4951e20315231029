"""`train.precision=fp8` (DeepSeek-V3 §3.3): bf16 parameters whose weight GEMMs run in FP8 (model.fp8).

- Which GEMMs: every Linear and grouped expert GEMM quantizes its weight in 128x128 blocks, except
  the output head's (also MTP's), which stays bf16; the router, norms and embedding never quantize.
- The pipeline's split backward (B now, the FP8 Wgrad later from the W store) gives the main grads
  of plain autograd bit for bit: both add the fp32 FP8 Wgrad into the fp32 main grad unrounded (the
  bf16 head, used twice, within a bf16 rounding: autograd sums its two uses in bf16, W adds each).
- Training: the tiny config's loss in fp8 follows bf16's (the paper's criterion is a relative error
  under 0.25%; the 400-step demo is a benchmark), the start-up says the GEMMs are emulated on this
  CPU, and a resumed fp8 run continues bit for bit.
"""
import json
import random

import pytest
import torch

import model.fp8 as fp8
from model.layers import GroupedLinear, Linear
from model.transformer import DeepSeekV3
from moe_train.config import ConfigError, load_config
from moe_train.train import Trainer, read_metrics
from parallel.data_parallel import build_buffers
from parallel.mixed_precision import accumulate_weight_grad, zero_grad_buffers
from parallel.pipeline.ir import ActionKind
from parallel.pipeline.wgrad import WeightGradStore, split_gemms
from tests.unit.test_train import records

TINY = "moe_train/configs/tiny.yaml"
SEED = 23


def tiny_model(gemms) -> DeepSeekV3:
    print(f"seed {SEED}")
    torch.manual_seed(SEED)
    model = DeepSeekV3(load_config(TINY).model, gemms=gemms).train()
    build_buffers(model, None, torch.bfloat16, shard=False)
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.randint(0, load_config(TINY).model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(SEED))
    return rows[:, :-1], rows[:, 1:]


def test_every_weight_gemm_but_the_heads_is_fp8(monkeypatch):
    model = tiny_model(fp8.Fp8GemmOps(sink=accumulate_weight_grad))
    names = {p.data_ptr(): n for n, p in model.named_parameters()}  # parameters share a bucket's storage
    quantized = set()
    quantize = fp8.quantize_128x128
    monkeypatch.setattr(fp8, "quantize_128x128", lambda w, *a: quantized.add(names[w.data_ptr()]) or quantize(w, *a))
    ids, labels = batch()
    model(ids, labels, aux_grad_scale=1.0).loss.backward()
    gemm_weights = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, (Linear, GroupedLinear))}
    assert "lm_head.weight" in gemm_weights and any(".experts." in n for n in gemm_weights)
    assert quantized == gemm_weights - {"lm_head.weight"}
    assert all(p.main_grad.any() for n, p in model.named_parameters() if n in quantized)


def test_the_split_backward_gives_the_main_grads_of_plain_autograd_bit_for_bit():
    ids, labels = batch()
    plain = tiny_model(fp8.Fp8GemmOps(sink=accumulate_weight_grad))
    plain(ids, labels, aux_grad_scale=1.0).loss.backward()
    store = WeightGradStore()
    split = tiny_model(split_gemms(store, fp8=True))
    zero_grad_buffers(split.parameters())
    with store.scope(0, 0, ActionKind.B):
        split(ids, labels, aux_grad_scale=1.0).loss.backward()
    deferred = {n for n, p in split.named_parameters() if not p.main_grad.any()}
    assert "layers.0.self_attn.o_proj.weight" in deferred and "lm_head.weight" in deferred  # W still to run
    store.run_w(0, 0)
    store.assert_empty()
    expected = dict(plain.named_parameters())
    for name, param in split.named_parameters():
        if name == "lm_head.weight":  # bf16, used by the head and MTP: autograd sums the two uses in bf16
            torch.testing.assert_close(param.main_grad, expected[name].main_grad, rtol=2 ** -7, atol=0)
        else:
            assert torch.equal(param.main_grad, expected[name].main_grad), name


def trainer(tmp_path, name: str, *overrides: str) -> Trainer:
    return Trainer(load_config(TINY, [f"logging.dir={tmp_path / name}", f"data.cache_dir={tmp_path / 'cache'}",
                                      "data.demo_max_bytes=200000", "logging.tensorboard=false", "train.steps=4",
                                      "train.log_interval=1", "checkpoint.interval=2", *overrides]))


def test_fp8_training_follows_bf16_and_resumes_bit_for_bit(tmp_path, capsys):
    reference = trainer(tmp_path, "bf16", "train.precision=bf16")
    bf16 = [m["loss"] for m in read_metrics([reference.train_step() for _ in range(4)])]
    capsys.readouterr()
    straight = trainer(tmp_path, "fp8", "train.precision=fp8")
    assert "the FP8 GEMMs are emulated" in capsys.readouterr().out
    assert straight.train() == 0
    losses = {r["step"]: r["loss"] for r in records(tmp_path / "fp8") if "loss" in r}
    relative = [abs(losses[step + 1] - bf16[step]) / bf16[step] for step in range(4)]
    print(f"|fp8 - bf16| / bf16 per step: {relative}")
    assert max(relative) < 2.5e-3 and any(r > 0 for r in relative)
    resumed = trainer(tmp_path, "resumed", "train.precision=fp8",
                      f"checkpoint.resume={tmp_path / 'fp8' / 'checkpoints' / 'iter_0000002'}")
    assert resumed.step == 2
    again = [m["loss"] for m in read_metrics([resumed.train_step() for _ in range(2)])]
    assert again == [losses[3], losses[4]]


@pytest.mark.parametrize("fp32_output", [True, False])
def test_where_torch_runs_the_fp8_gemms_the_start_up_says_which_do(tmp_path, capsys, monkeypatch, fp32_output):
    monkeypatch.setattr("model.fp8.blockwise_scaled_mm_supported",
                        lambda device, out_dtype=torch.bfloat16: fp32_output or out_dtype == torch.bfloat16)
    trainer(tmp_path, "fp8", "train.precision=fp8")
    out = capsys.readouterr().out
    weight_grads = "the weight gradients too" if fp32_output else "the weight gradients are emulated"
    assert f"the FP8 GEMMs run torch's blockwise scaled_mm on cpu, {weight_grads}" in out
    assert "the routed experts' grouped GEMMs one kernel GEMM per expert" in out


def test_where_torch_does_not_run_them_the_start_up_says_they_are_emulated(tmp_path, capsys):
    trainer(tmp_path, "fp8", "train.precision=fp8")
    assert "torch's blockwise FP8 scaled_mm does not run on cpu; the FP8 GEMMs are emulated" in capsys.readouterr().out


def test_fp8_refuses_torch_compile():
    with pytest.raises(ConfigError, match="train.compile"):
        load_config(TINY, ["train.precision=fp8", "train.compile=regions"])


def test_the_fp8_curve_benchmark_reports_both_relative_errors(tmp_path, capsys, monkeypatch):
    """benchmarks/fp8_loss_curves.py on 2 tiny steps: both curves, the training and validation losses'
    relative errors and the paper's criterion (the README's row is its 400-step demo run); a second
    invocation with the same --runs-file trains nothing and prints the same report."""
    from benchmarks import fp8_loss_curves

    monkeypatch.setattr("sys.argv", ["fp8_loss_curves", "--config", TINY, "--steps", "2",
                                     "--set", f"data.cache_dir={tmp_path / 'cache'}",
                                     "--set", "data.demo_max_bytes=200000", "--runs-file", str(tmp_path / "runs.json")])
    fp8_loss_curves.main()
    out = capsys.readouterr().out
    assert "step    2  bf16 " in out and " fp8 " in out
    assert "final training loss (mean of the last 10 steps): bf16" in out and "validation loss: bf16" in out
    assert "the paper's criterion, under 0.25%: met" in out
    monkeypatch.setattr(fp8_loss_curves, "train_run", None)  # a run trained again would fail
    fp8_loss_curves.main()
    again = capsys.readouterr().out
    assert "bf16: the run kept in" in again and "fp8: the run kept in" in again
    assert again[again.index("config "):] == out[out.index("config "):]


def test_inside_weights_fixed_every_micro_batch_shares_one_fp8_copy_of_a_weight():
    """One optimizer step's forwards save the same FP8 weight (one copy, not one per micro-batch in
    flight); outside the scope, or in the next one after the weight changed, a fresh quantization."""
    ops = fp8.Fp8GemmOps(sink=accumulate_weight_grad)
    model = tiny_model(ops)
    weight = model.layers["0"].self_attn.o_proj.weight
    ids, labels = batch()

    def two_micro_batches() -> set[int]:
        """Storages of the FP8 o_proj weights the two forwards' graphs saved, while both are alive."""
        outs = [model(ids, labels, aux_grad_scale=1.0) for _ in range(2)]
        stack, seen, found = [out.loss.grad_fn for out in outs], set(), set()
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if type(node).__name__ == "Fp8LinearFunctionBackward" and node.weight is weight:
                found.add(node.saved_tensors[0].untyped_storage().data_ptr())
            stack += [next_fn for next_fn, _ in node.next_functions]
        sum(out.loss for out in outs).backward()
        return found

    with ops.weights_fixed():
        assert len(two_micro_batches()) == 1
        first = ops.quantized_weight(weight)
    assert len(two_micro_batches()) == 2
    with torch.no_grad():
        weight.mul_(2)
    with ops.weights_fixed():
        assert torch.equal(ops.quantized_weight(weight).scale, 2 * first.scale)


def test_a_dispatched_row_quantizes_back_to_its_own_fp8_values_and_scales():
    """parallel.fp8_dispatch sends E4M3 rows with power-of-two scales; the receiver dequantizes them to
    bf16 (exactly: a 4-bit significand times a power of two) and the experts' gate/up GEMM, whose inputs
    model.fp8 quantizes with power-of-two scales too, quantizes them back to the same values: the same
    E4M3 codes and scale, or, where a tile's largest value rounded down to 224 (a power of two), half the
    scale and every code doubled, exactly. Either way the GEMM computes with the dispatched payload's
    values. (Tiles whose amax is under DeepEP's 1e-4 floor are the exception; these rows are above it.)"""
    from parallel.dispatch.fp8 import dequantize_e4m3, quantize_e4m3

    seed = random.SystemRandom().randrange(2 ** 32)
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.exp2(torch.randint(-6, 7, (64, 3), generator=gen).float()).repeat_interleave(128, dim=1)
    rows = (torch.randn(64, 384, generator=gen) * magnitudes).bfloat16()
    sent, scales = quantize_e4m3(rows, round_scale=True)
    received = dequantize_e4m3(sent, scales, torch.bfloat16)
    again = fp8.quantize_1x128(received, power_of_two_scale=True)
    assert torch.equal(fp8.dequantize(again), received.float())
    same = again.scale == scales
    assert torch.equal(again.scale[~same], scales[~same] / 2)
    codes, sent_codes = (t.float().view(64, 3, 128) for t in (again.data, sent))
    assert torch.equal(codes[same], sent_codes[same]) and torch.equal(codes[~same], 2 * sent_codes[~same])
    print(f"{int(same.sum())} of {same.numel()} tiles kept their scale, the others halved it")
    amax_grid = fp8.quantize_1x128(received)  # without power-of-two scales the values move
    assert not torch.equal(fp8.dequantize(amax_grid), received.float())


SMALL_BATCH = ("train.global_batch_size=2", "train.micro_batch_size=2", "train.seq_length=32", "train.eval_iters=1")


def test_the_fp8_curve_benchmark_keeps_chosen_groups_on_bf16_gemms(tmp_path, capsys, monkeypatch):
    """The ablations: every group on `--bf16-gemms` (with `--bf16-swiglu-input`) makes the fp8 run the bf16
    run bit for bit (so the groups cover every FP8 GEMM and nothing else differs); one group alone does
    not, and `--bf16-swiglu-input` alone changes the fp8 run (so it removes the FP8 cache's rounding)."""
    from benchmarks import fp8_loss_curves

    def curves(*ablation: str) -> tuple[list[float], list[float]]:
        args = ["fp8_loss_curves", "--config", TINY, "--steps", "1", "--set", f"data.cache_dir={tmp_path / 'cache'}",
                "--set", "data.demo_max_bytes=200000", "--runs-file", str(tmp_path / "runs.json"),
                *(arg for setting in SMALL_BATCH for arg in ("--set", setting))]
        monkeypatch.setattr("sys.argv", args + list(ablation))
        fp8_loss_curves.main()
        runs = {json.dumps(json.loads(key)[4:]): [*run["losses"], run["valid_loss"]]
                for key, run in json.loads((tmp_path / "runs.json").read_text()).items()}
        print(f"{ablation}: {runs}")
        return runs["[]"], runs[max(runs, key=len)] if len(runs) > 1 else runs["[]"]

    every_group = [arg for group in fp8_loss_curves.FP8_MODULE_GROUPS for arg in ("--bf16-gemms", group)]
    bf16, all_bf16 = curves(*every_group, "--bf16-swiglu-input")
    assert "relative error 0.000%" in capsys.readouterr().out
    assert all_bf16 == bf16
    (tmp_path / "runs.json").unlink()
    _, routed_bf16 = curves("--bf16-gemms", "routed experts")
    assert routed_bf16 != bf16
    (tmp_path / "runs.json").unlink()
    _, swiglu_bf16 = curves("--bf16-swiglu-input")
    (tmp_path / "runs.json").unlink()
    _, fp8 = curves()
    print(f"bf16 {bf16}, fp8 {fp8}, with the routed experts on bf16 GEMMs {routed_bf16}, with their SwiGLU "
          f"input in bf16 {swiglu_bf16}")
    assert len({bf16[-1], fp8[-1], swiglu_bf16[-1]}) == 3  # the validation loss after the step


def test_the_fp8_gradient_error_benchmark_shows_fp8_gemms_further_from_fp32_than_bf16(tmp_path, capsys):
    """benchmarks/fp8_gradient_error.py after one step: a row per parameter group, every group whose GEMMs
    are FP8 has a larger gradient error against fp32 with FP8 GEMMs than with bf16 GEMMs (the
    README's table is its demo run)."""
    from benchmarks.fp8_gradient_error import gradient_errors

    gradient_errors(TINY, 1, [f"data.cache_dir={tmp_path / 'cache'}", "data.demo_max_bytes=200000", *SMALL_BATCH])
    out = capsys.readouterr().out
    print(out)
    lines = out.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("parameters")) + 1:]
    rows = {line[:28].strip(): [float(v) for v in line[28:].split()] for line in table}
    assert set(rows) == {"norms, router, embedding", "attention projections", "routed experts",
                         "shared experts", "dense MLP", "MTP projection"}
    for group in ("attention projections", "routed experts", "shared experts", "dense MLP"):
        bf16_error, fp8_error = rows[group][:2]
        assert 0 < bf16_error < fp8_error, (group, rows[group])
    assert any(line.startswith("loss: bf16 ") and "; FP8 against bf16 " in line for line in lines)
