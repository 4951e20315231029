"""Per-MoE-layer metrics: the table's figures from known loads and biases, which rows a pipeline stage
fills, a training run's metrics.jsonl, and the keys TensorBoard and W&B receive. Layouts against one
process: tests/distributed/test_moe_layer_metrics.py."""
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.transformer import DeepSeekV3
from moe_train.config import load_config
from moe_train.metrics import MetricsLogger
from moe_train.moe_metrics import STATS, MoELayerMetrics, layer_label
from moe_train.train import main, read_metrics

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "moe_train/configs/tiny.yaml"
LAYERS = ["layer_1", "layer_2", "layer_3", "mtp_0"]


def test_table_of_known_loads_and_biases():
    args = load_config(TINY).model
    metrics = MoELayerMetrics(DeepSeekV3(args), args, torch.device("cpu"))
    assert metrics.labels == LAYERS
    loads = torch.tensor([[8.0, 0, 0, 0, 0, 0, 0, 0], [1.0] * 8, [2.0, 2, 0, 0, 1, 1, 1, 1], [0.0] * 8])
    biases = torch.tensor([[0.5, -0.25] + [0.0] * 6, [0.0] * 8, [0.1] * 8, [-1.0, 1.0] + [0.0] * 6])
    table = metrics.table(loads, biases)
    assert table[:, 0].tolist() == [8.0, 1.0, 2.0, 0.0]
    assert table[:, 1].tolist() == [7 / 8, 0.0, 2 / 8, 1.0]
    assert table[:, 2].tolist() == [0.75, 0.0, 0.0, 2.0]
    record = metrics.record(read_metrics([{"step": 1, "table": table}])[0]["table"])  # as the log reads it
    assert list(record) == [f"moe/{layer}/{stat}" for layer in LAYERS for stat in STATS]
    assert record["moe/layer_3/experts_unused"] == 0.25 and record["moe/mtp_0/bias_spread"] == 2.0


def test_a_pipeline_stage_fills_only_its_layers_rows():
    args = load_config(TINY).model
    stage = DeepSeekV3(args)
    del stage.layers["1"], stage.layers["2"]  # the MoE layers of a stage holding layer 3 and MTP
    metrics = MoELayerMetrics(stage, args, torch.device("cpu"))
    table = metrics.table(torch.tensor([[2.0, 0], [1.0, 1]]), torch.zeros(2, 2))
    assert table.tolist() == [[0.0] * 3, [0.0] * 3, [2.0, 0.5, 0.0], [1.0, 0.0, 0.0]]
    assert [layer_label(n) for n in ("layers.12.mlp", "mtp.1.block.mlp")] == ["layer_12", "mtp_1"]


def test_training_logs_every_layer_and_plots_the_heatmap(tmp_path):
    run = tmp_path / "run"
    sets = [f"logging.dir={run}", "train.threads=1", "logging.tensorboard=false", "data.demo_max_bytes=100000",
            f"data.cache_dir={tmp_path / 'cache'}", "train.steps=4", "train.log_interval=2"]
    assert main(["--config", str(TINY), *[a for kv in sets for a in ("--set", kv)]]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        ratios = [r[f"moe/{layer}/load_max_over_mean"] for layer in LAYERS]
        assert max(ratios) == r["expert_load_max_over_mean"] and min(ratios) >= 1.0
        assert all(0 <= r[f"moe/{layer}/experts_unused"] <= 1 for layer in LAYERS)
        # tiny's bias moves every layer's biases by +-1e-3 per step, so its spread is at most 2e-3 per step
        assert all(0 < r[f"moe/{layer}/bias_spread"] <= 2e-3 * r["step"] + 1e-6 for layer in LAYERS)
    spec = importlib.util.spec_from_file_location("plot_metrics", ROOT / "scripts/plot_metrics.py")
    plot_metrics = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_metrics)
    layers, steps, loads = plot_metrics.layer_loads(records)
    assert layers == LAYERS and steps == [2, 4]
    assert loads == [[r[f"moe/{layer}/load_max_over_mean"] for r in records] for layer in LAYERS]
    plot = subprocess.run([sys.executable, "scripts/plot_metrics.py", str(run / "metrics.jsonl")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0 and (run / "curves.png").read_bytes()[:4] == b"\x89PNG", plot.stderr


class Recorder:
    """Stands in for TensorBoard's SummaryWriter and a W&B run (neither is installed in CI)."""

    def __init__(self):
        self.scalars: dict[str, float] = {}

    def add_scalar(self, key, value, step):
        self.scalars[key] = value

    def log(self, scalars, step):
        self.scalars.update(scalars)


@pytest.mark.parametrize("backend", ["writer", "wandb_run"])
def test_tensorboard_and_wandb_receive_every_layer(tmp_path, backend):
    logger = MetricsLogger(tmp_path, 10, enabled=True, tensorboard=False, stream=io.StringIO())
    recorder = Recorder()
    setattr(logger, backend, recorder)
    record = {"step": 1, "loss": 1.0, "lm_loss": 1.0, "mtp_loss": 1.0, "aux_loss": 0.0, "lr": 0.1, "grad_norm": 1.0,
              "tokens_per_s": 1.0, "expert_load_max_over_mean": 2.0, "eta_s": 0.0,
              "moe/layer_1/load_max_over_mean": 2.0, "moe/layer_1/experts_unused": 0.25, "moe/layer_1/bias_spread": 0.1}
    logger.log(record)
    assert {k: v for k, v in recorder.scalars.items() if "moe/" in k} == {
        "train/moe/layer_1/load_max_over_mean": 2.0, "train/moe/layer_1/experts_unused": 0.25,
        "train/moe/layer_1/bias_spread": 0.1}
