"""Draw loss and expert-balance curves from a run's metrics.jsonl to a PNG.

With the per-MoE-layer figures (`moe/<layer>/load_max_over_mean`, moe_train.moe_metrics) a third
panel is a layers-by-steps heatmap of each layer's max/mean expert load.

    python scripts/plot_metrics.py runs/demo/metrics.jsonl -o runs/demo/curves.png
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


LAYER_LOAD = re.compile(r"moe/(layer|mtp)_(\d+)/load_max_over_mean")


def layer_loads(records: list[dict]) -> tuple[list[str], list[int], list[list[float]]]:
    """(layer labels in model order, steps, [layer][step] max/mean load) of the records that hold them."""
    keys = sorted({k for r in records for k in r if LAYER_LOAD.fullmatch(k)},
                  key=lambda k: (LAYER_LOAD.fullmatch(k)[1] == "mtp", int(LAYER_LOAD.fullmatch(k)[2])))
    held = [r for r in records if keys and keys[0] in r]
    return ([k.split("/")[1] for k in keys], [r["step"] for r in held],
            [[r.get(k, float("nan")) for r in held] for k in keys])


def plot(records: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    layers, layer_steps, loads = layer_loads(records)
    fig, axes = plt.subplots(1, 3 if layers else 2, figsize=(18 if layers else 12, 4.5))
    ax_loss, ax_balance = axes[:2]
    for key, label in (("loss", "total"), ("lm_loss", "LM"), ("mtp_loss", "MTP")):
        ax_loss.plot(steps, [r[key] for r in records], label=label)
    valid = [(r["step"], r["valid_loss"]) for r in records if "valid_loss" in r]
    if valid:
        ax_loss.plot(*zip(*valid), "o-", label="valid LM")
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_balance.plot(steps, [r["expert_load_max_over_mean"] for r in records], color="tab:red")
    ax_balance.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax_balance.set(xlabel="step", ylabel="max / mean expert load (worst layer)", title="expert load balance")
    ax_balance.grid(alpha=0.3)
    if layers:
        ax_layers = axes[2]
        image = ax_layers.imshow(loads, aspect="auto", interpolation="nearest", cmap="magma",
                                 extent=(layer_steps[0] - 0.5, layer_steps[-1] + 0.5, len(layers) - 0.5, -0.5))
        ax_layers.set_yticks(range(len(layers)), layers)
        ax_layers.set(xlabel="step", title="max / mean expert load per MoE layer")
        fig.colorbar(image, ax=ax_layers)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", type=Path)
    parser.add_argument("-o", "--output", type=Path, default=None, help="PNG path (default: beside the metrics)")
    opts = parser.parse_args(argv)
    if not opts.metrics.is_file():
        print(f"error: {opts.metrics}: not found", file=sys.stderr)
        return 2
    records = read_metrics(opts.metrics)
    if not records:
        print(f"error: {opts.metrics}: no records", file=sys.stderr)
        return 2
    out = opts.output or opts.metrics.with_name("curves.png")
    plot(records, out, str(opts.metrics.parent))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
