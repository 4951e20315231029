"""Forward+backward tokens/s of our model versus transformers' DeepseekV3ForCausalLM, and of ours
in bf16 and under torch.compile.

Both models run the same small DeepSeek-V3 config (the demo shape by default) with the same
weights, threads and batch, in fp32, in the same process; the ratio is what to read. MTP is off in
ours (HF's CausalLM has none), and the balance loss is off (HF computes none). Our model also runs
with bf16 parameters (`train.precision=bf16`, parallel.mixed_precision), with `train.compile=regions`
(fp32) and with `train.compile=model` (bf16); each ratio compares steps timed in alternation in this run (compiling
happens in the warm-up, minutes on a CPU).

    python benchmarks/model_step.py [--config moe_train/configs/demo.yaml] [--batch 8] [--seq 256]
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import tempfile
import time
from typing import Callable

import torch

from moe_train.checkpoint.hf import load_hf_checkpoint, save_hf_checkpoint
from model.transformer import DeepSeekV3
from moe_train.config import load_config
from moe_train.runtime import compile_model
from parallel.data_parallel import build_buffers
from parallel.mixed_precision import release_grads


def time_alternating(steps: dict, warmup: int, repeats: int) -> dict[str, float]:
    """Median seconds per step of each callable, run in alternation so load changes hit both."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="moe_train/configs/demo.yaml")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)

    from transformers import DeepseekV3ForCausalLM

    args = dataclasses.replace(load_config(opts.config).model, mtp_num_layers=0, moe_aux_loss_coeff=0.0)
    ours = DeepSeekV3(args).train()
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_checkpoint(ours, tmp + "/hf")
        hf = DeepseekV3ForCausalLM.from_pretrained(tmp + "/hf").train()
        ours = load_hf_checkpoint(tmp + "/hf").train()
    ids = torch.randint(0, args.vocab_size, (opts.batch, opts.seq + 1))
    inputs, labels = ids[:, :-1], ids[:, 1:]

    def step_of(model: torch.nn.Module) -> Callable[[], None]:
        def step() -> None:
            release_grads(model.parameters())
            model(inputs, labels, aux_grad_scale=1.0).loss.backward()
        return step

    def step_hf() -> None:
        hf.zero_grad(set_to_none=True)
        hf(input_ids=inputs, labels=ids[:, :-1].clone()).loss.backward()

    def copy_of_ours(precision: str) -> torch.nn.Module:
        model = copy.deepcopy(ours)
        if precision == "bf16":
            build_buffers(model, None, torch.bfloat16, shard=False)
        return model

    bf16 = copy_of_ours("bf16")
    compiled = {}
    for mode, precision in (("regions", "fp32"), ("model", "bf16")):
        compiled[mode] = copy_of_ours(precision)
        print(f"train.compile={mode} ({precision}): {compile_model(compiled[mode], mode, precision)}")
    rows = {  # name: (step, label)
        "hf": (step_hf, "transformers DeepseekV3ForCausalLM, fp32"),
        "ours": (step_of(ours), "ours (model.DeepSeekV3), fp32"),
        "bf16": (step_of(bf16), "ours, bf16 parameters"),
        "regions": (step_of(compiled["regions"]), "ours, fp32, train.compile=regions"),
        "model": (step_of(compiled["model"]), "ours, bf16, train.compile=model"),
    }
    tokens = opts.batch * opts.seq
    medians = time_alternating({name: step for name, (step, _) in rows.items()}, opts.warmup, opts.repeats)
    print(f"config {opts.config} batch {opts.batch} x seq {opts.seq}, {opts.threads} threads, "
          f"attn={hf.config._attn_implementation}")
    for name, (_, label) in rows.items():
        print(f"{label + ':':42s} {tokens / medians[name]:8.0f} tokens/s ({medians[name] * 1000:.0f} ms/step)")
    print(f"ratio ours / transformers (fp32):        {medians['hf'] / medians['ours']:.2f}x")
    print(f"step-time ratio bf16 / fp32 (eager):     {medians['bf16'] / medians['ours']:.2f}")
    print(f"speed-up compile=regions / eager (fp32): {medians['ours'] / medians['regions']:.2f}x")
    print(f"speed-up compile=model / eager (bf16):   {medians['bf16'] / medians['model']:.2f}x")


if __name__ == "__main__":
    main()
