"""A tiny training checkpoint (random weights) for the generation tests and the README commands."""
from __future__ import annotations

from pathlib import Path

import torch

from model.init import initialize_parameters
from model.transformer import DeepSeekV3
from moe_train.checkpoint.dcp import save_checkpoint
from moe_train.config import load_config, to_yaml

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "moe_train/configs/tiny.yaml"


def write_tiny_checkpoint(root: Path, seed: int, std: float = 0.1, step: int = 3) -> DeepSeekV3:
    """Save the tiny config's model, initialized from `seed` with `std` (wider than training's 0.02 so
    the greedy choices are not near-ties), as a checkpoint root at `root` with its config.yaml; returns it."""
    config = load_config(TINY)
    model = DeepSeekV3(config.model)
    initialize_parameters(model, seed, std)
    generator = torch.Generator().manual_seed(seed)
    for router in model.routers():
        router.e_score_correction_bias.copy_(torch.rand(router.e_score_correction_bias.shape, generator=generator) / 10 - 0.05)
    save_checkpoint(root, step, model, None, {"step": step}, keep=1, text_files={"config.yaml": to_yaml(config)})
    return model.eval()
