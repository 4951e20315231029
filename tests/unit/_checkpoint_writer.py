"""Saves checkpoints of a small DeepSeekV3 in a loop until it is killed (the kill-during-save tests).

`python -m tests.unit._checkpoint_writer ROOT KEEP`: resumes from the latest checkpoint under ROOT
if there is one, then for step = last + 1, last + 2, ... fills every model tensor and the AdamW
moments with the step number, saves, and prints the step once `save_checkpoint` has returned.

`python -m tests.unit._checkpoint_writer ROOT KEEP async`: the same with `BackgroundSaves`, each
tensor write slowed down by WRITE_DELAY_S so that a kill lands in the background write: prints
`writing STEP` once a save has started and `published STEP` once it is the latest. The model is
filled with the next step while the previous save is still being written.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp

from model.args import ModelArgs
from model.transformer import DeepSeekV3
from moe_train.checkpoint.dcp import BackgroundSaves, load_checkpoint, resolve_resume, save_checkpoint

WRITE_DELAY_S = 1.0


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


def slowed_write(delay_s: float) -> Callable[..., Any]:
    """DCP's tensor write (`FileSystemWriter.write_data`), starting `delay_s` late."""
    write_data = dcp.FileSystemWriter.write_data

    def late(self: dcp.FileSystemWriter, *args: Any) -> Any:
        time.sleep(delay_s)
        return write_data(self, *args)

    return late


def main_async(root: str, keep: int, model: DeepSeekV3, optimizer: torch.optim.AdamW, step: int) -> None:
    dcp.FileSystemWriter.write_data = slowed_write(WRITE_DELAY_S)
    saves = BackgroundSaves()
    while True:
        step += 1
        fill(model, optimizer, float(step))
        if saves.wait() is not None:
            print(f"published {step - 1}", flush=True)
        saves.start(root, step, model, optimizer, {"step": step}, keep=keep, text_files={"step.txt": f"{step}\n"})
        print(f"writing {step}", flush=True)


def main(root: str, keep: int, mode: str) -> None:
    model, optimizer = build(seed=0)
    path = resolve_resume("auto", root)
    step = 0 if path is None else load_checkpoint(path, model, optimizer)["step"]
    if mode == "async":
        return main_async(root, keep, model, optimizer, step)
    while True:
        step += 1
        fill(model, optimizer, float(step))
        save_checkpoint(root, step, model, optimizer, {"step": step}, keep=keep,
                        text_files={"step.txt": f"{step}\n"})
        print(step, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "sync")
