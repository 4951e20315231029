"""Process-level set-up for a run: device choice, CPU threads, seeding, torch.compile."""
from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

from model.attention import MLA
from model.layers import RMSNorm, SwiGLU
from moe_train.config import ConfigError, TrainConfig

COMPILED_REGIONS = (MLA, SwiGLU, RMSNorm)  # train.compile=regions: attention, dense MLP / shared expert, norms


def device_type(train: TrainConfig) -> str:
    """'cuda' or 'cpu': `train.device` with auto resolved (a ConfigError for cuda without CUDA)."""
    if train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError([("train.device", "cuda, but CUDA is not available on this machine (use cpu, or auto)")])
    return "cuda" if train.device == "cuda" or (train.device == "auto" and torch.cuda.is_available()) else "cpu"


def select_device(train: TrainConfig) -> torch.device:
    if device_type(train) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def configure_threads(train: TrainConfig) -> None:
    if train.threads:
        torch.set_num_threads(train.threads)


def grouped_mm_compile_problem(dtype: torch.dtype) -> str | None:
    """Why torch.compile cannot trace the routed experts' `torch._grouped_mm` with `dtype` operands
    (the first line of its meta kernel's error; it takes bf16 only), or None."""
    if not hasattr(torch, "_grouped_mm"):
        return None  # model.layers uses its per-group reference
    x = torch.empty(16, 16, dtype=dtype, device="meta")
    try:
        torch._grouped_mm(x, x.new_empty(1, 16, 16), offs=torch.full((1,), 16, dtype=torch.int32, device="meta"))
    except RuntimeError as err:
        return str(err).splitlines()[0]
    return None


def compile_model(model: nn.Module, mode: str, precision: str) -> str:
    """Apply `train.compile` in place (`nn.Module.compile`: parameter names, hence checkpoints, stay
    the same); returns one line saying what is compiled, with the reason where `model` fell back.

    `model` compiles the whole forward where the grouped expert GEMMs can be traced (bf16), else
    falls back to `regions`.
    """
    if mode == "none":
        return "none"
    fallback = ""
    if mode == "model":
        dtype = torch.bfloat16 if precision == "bf16" else next(model.parameters()).dtype
        problem = grouped_mm_compile_problem(dtype)
        if problem is None:
            model.compile()
            return "model"
        fallback = f"; train.compile=model fell back to regions: {dtype} grouped GEMMs cannot be traced ({problem})"
    regions = [module for module in model.modules() if isinstance(module, COMPILED_REGIONS)]
    for module in regions:
        module.compile()
    return f"regions ({len(regions)} attention, MLP and norm modules){fallback}"
