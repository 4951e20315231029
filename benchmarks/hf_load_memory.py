"""Peak memory of a process loading an HF folder: the whole model (pp 1) versus one stage of pp 2.

Writes the HF folder of a model of about 0.9 GB (fp32; default shape below) once, then starts one
fresh process per case. Each builds its part (the model, or the DeepSeekV3 parts of stage s of 2) and
loads it through `moe_train.checkpoint.hf_checkpoint.load_hf_weights`; it reports its peak resident memory
(VmHWM) above what it held after its imports, and the bytes of the tensors it owns. With
per-rank reading that peak follows the shard, not the model.

    python benchmarks/hf_load_memory.py [--layers 8] [--hidden 512] [--experts 32]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from model.args import ModelArgs


def shape(layers: int, hidden: int, experts: int) -> ModelArgs:
    return ModelArgs(num_layers=layers, hidden_size=hidden, ffn_hidden_size=4 * hidden, num_attention_heads=8,
                     q_lora_rank=hidden // 2, kv_lora_rank=hidden // 4, qk_head_dim=64, qk_pos_emb_head_dim=32,
                     v_head_dim=64, num_moe_experts=experts, moe_ffn_hidden_size=hidden,
                     moe_shared_expert_intermediate_size=hidden, moe_router_topk=4, moe_router_num_groups=4,
                     moe_router_group_topk=2, first_k_dense_replace=1, mtp_num_layers=1, vocab_size=4096)


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM: ru_maxrss would carry the parent's peak over the exec)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def load_case(folder: str, args_json: str, stage: int | None) -> None:
    """One measurement (in its own process): print {"peak": bytes above the post-import peak, "owned": bytes}."""
    from model.transformer import DeepSeekV3
    from moe_train.checkpoint.hf_checkpoint import load_hf_weights
    from parallel.pipeline.stage import build_stages, stage_specs

    args = ModelArgs(**json.loads(args_json))
    before = peak_rss_bytes()
    if stage is None:
        model = DeepSeekV3(args)
    else:
        model, _ = build_stages(args, stage_specs(args, 2), [stage])
    load_hf_weights(Path(folder), model)
    owned = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(json.dumps({"peak": peak_rss_bytes() - before, "owned": owned}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=32)
    opts = parser.parse_args()
    args = shape(opts.layers, opts.hidden, opts.experts)
    from moe_train.checkpoint.hf import save_hf_checkpoint
    from model.transformer import DeepSeekV3

    torch.manual_seed(0)  # the weights' values do not matter here
    print("seed 0")
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_checkpoint(DeepSeekV3(args), Path(tmp) / "hf")
        size = sum(f.stat().st_size for f in (Path(tmp) / "hf").glob("*.safetensors"))
        print(f"HF folder: {size / 2**20:.0f} MiB of safetensors")
        args_json = json.dumps(args.__dict__)
        for label, stage in (("pp 1 (whole model)", None), ("pp 2, stage 0", 0), ("pp 2, stage 1", 1)):
            out = subprocess.run([sys.executable, __file__, "--case", str(Path(tmp) / "hf"), args_json, str(stage)],
                                 capture_output=True, text=True, check=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            print(f"{label}: peak +{result['peak'] / 2**20:.0f} MiB while loading, "
                  f"owns {result['owned'] / 2**20:.0f} MiB of tensors")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--case"]:
        load_case(sys.argv[2], sys.argv[3], None if sys.argv[4] == "None" else int(sys.argv[4]))
    else:
        main()
