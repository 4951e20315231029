"""Process-level set-up for a run: device choice, CPU threads, seeding, mixed-precision context."""
from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

from moe_train.config import TrainConfig


def select_device(train: TrainConfig) -> torch.device:
    if train.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but CUDA is not available on this machine")
    if train.device == "cuda" or (train.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast (fp32 master weights and optimizer state); fp32 runs with no context."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def configure_threads(train: TrainConfig) -> None:
    if train.threads:
        torch.set_num_threads(train.threads)
