"""Per-MoE-layer metrics of a step: for every MoE layer of the whole model (decoder layers and MTP
blocks), the max/mean expert load, the fraction of experts that received no token, and the spread
(max - min) of the router's correction bias.

A rank holds the routers of its pipeline stages only, so it fills the rows of its layers and leaves
the others 0; the trainer reduces the table with MAX over the ranks that hold different stages (every
entry is >= 0, and ranks holding the same layer hold the same globally reduced loads and biases), so
every layout logs the same figures as one process.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from model.args import ModelArgs
from model.moe import MoE
from model.transformer import DeepSeekV3

STATS = ("load_max_over_mean", "experts_unused", "bias_spread")  # the columns of `MoELayerMetrics.table`
MOE_LAYERS = "moe_layers"  # the step metric holding the table until the log expands it (`MoELayerMetrics.record`)


def layer_label(module_name: str) -> str:
    """"layers.3.mlp" -> "layer_3", "mtp.0.block.mlp" -> "mtp_0"."""
    match = re.fullmatch(r"(layers|mtp)\.(\d+)\..*", module_name)
    if match is None:
        raise ValueError(f"{module_name}: not a decoder layer's or an MTP block's MoE")
    return f"{'layer' if match[1] == 'layers' else 'mtp'}_{match[2]}"


def metric_key(label: str, stat: str) -> str:
    return f"moe/{label}/{stat}"


class MoELayerMetrics:
    """Which rows of the whole model's MoE-layer table this rank's routers fill."""

    def __init__(self, model: nn.Module, args: ModelArgs, device: torch.device) -> None:
        with torch.device("meta"):
            whole = DeepSeekV3(args)
        self.labels = [layer_label(name) for name, m in whole.named_modules() if isinstance(m, MoE)]
        local = [layer_label(name) for name, m in model.named_modules() if isinstance(m, MoE)]
        # on the device, so that filling the table makes no host sync
        self.rows = torch.tensor([self.labels.index(label) for label in local], dtype=torch.long, device=device)

    def table(self, loads: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
        """[MoE layers of the whole model, len(STATS)] from this rank's globally reduced `loads` and
        `biases` ([its MoE layers, experts], in `model.routers()` order); other layers' rows are 0."""
        table = torch.zeros(len(self.labels), len(STATS), device=loads.device)
        if len(self.rows):
            ratio = loads.max(dim=1).values / loads.mean(dim=1).clamp_min(1e-9)
            unused = (loads == 0).float().mean(dim=1)
            spread = biases.max(dim=1).values - biases.min(dim=1).values
            table[self.rows] = torch.stack([ratio, unused, spread], dim=1)
        return table

    def record(self, values: list[float]) -> dict[str, float]:
        """The log record's keys of a table read back to the host (row-major, as `read_metrics` returns it)."""
        return {metric_key(label, stat): values[i * len(STATS) + j] for i, label in enumerate(self.labels)
                for j, stat in enumerate(STATS)}
