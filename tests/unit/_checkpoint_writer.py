"""Saves checkpoints of a small DeepSeekV3 in a loop until it is killed (the kill-during-save test).

`python -m tests.unit._checkpoint_writer ROOT KEEP`: resumes from the latest checkpoint under ROOT
if there is one, then for step = last + 1, last + 2, ... fills every model tensor and the AdamW
moments with the step number, saves, and prints the step once `save_checkpoint` has returned.
"""
from __future__ import annotations

import sys

import torch

from model.args import ModelArgs
from model.transformer import DeepSeekV3
from moe_train.checkpoint.dcp import load_checkpoint, resolve_resume, save_checkpoint


def build(seed: int) -> tuple[DeepSeekV3, torch.optim.AdamW]:
    """A model and an AdamW whose state exists (one real step on random tokens)."""
    torch.manual_seed(seed)
    model = DeepSeekV3(ModelArgs())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, model.args.vocab_size, (2, 9))
    model(ids[:, :-1], ids[:, 1:], aux_grad_scale=1.0).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


@torch.no_grad()
def fill(model: DeepSeekV3, optimizer: torch.optim.AdamW, value: float) -> None:
    for tensor in model.state_dict().values():
        tensor.fill_(value)
    for state in optimizer.state.values():
        state["exp_avg"].fill_(value)
        state["exp_avg_sq"].fill_(value)


def main(root: str, keep: int) -> None:
    model, optimizer = build(seed=0)
    path = resolve_resume("auto", root)
    step = 0 if path is None else load_checkpoint(path, model, optimizer)["step"]
    while True:
        step += 1
        fill(model, optimizer, float(step))
        save_checkpoint(root, step, model, optimizer, {"step": step}, keep=keep,
                        text_files={"step.txt": f"{step}\n"})
        print(step, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
