"""Forward+backward tokens/s of our model versus transformers' DeepseekV3ForCausalLM.

Both run the same small DeepSeek-V3 config (the demo shape by default) with the same weights,
threads, batch and precision, in the same process; the ratio is what to read. MTP is off in ours
(HF's CausalLM has none), and the balance loss is off (HF computes none).

    python benchmarks/model_step.py [--config moe_train/configs/demo.yaml] [--batch 8] [--seq 256]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

import torch

from model.hf import load_hf_checkpoint, save_hf_checkpoint
from model.transformer import DeepSeekV3
from moe_train.config import load_config


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

    def step_ours() -> None:
        ours.zero_grad(set_to_none=True)
        ours(inputs, labels).loss.backward()

    def step_hf() -> None:
        hf.zero_grad(set_to_none=True)
        hf(input_ids=inputs, labels=ids[:, :-1].clone()).loss.backward()

    tokens = opts.batch * opts.seq
    medians = time_alternating({"hf": step_hf, "ours": step_ours}, opts.warmup, opts.repeats)
    t_hf, t_ours = medians["hf"], medians["ours"]
    print(f"config {opts.config} batch {opts.batch} x seq {opts.seq}, {opts.threads} threads, fp32, "
          f"attn={hf.config._attn_implementation}")
    print(f"transformers DeepseekV3ForCausalLM: {tokens / t_hf:10.0f} tokens/s ({t_hf * 1000:.0f} ms/step)")
    print(f"ours (model.DeepSeekV3):            {tokens / t_ours:10.0f} tokens/s ({t_ours * 1000:.0f} ms/step)")
    print(f"ratio ours / transformers: {t_hf / t_ours:.2f}x")


if __name__ == "__main__":
    main()
