"""Hugging Face DeepSeek-V3 interop: config mapping both ways, checkpoint import and export.

On disk the HF layout stores routed experts per expert (`mlp.experts.{e}.{gate,up,down}_proj`),
MTP depth k as decoder layer `num_layers + k - 1` (with copies of the shared embedding and head),
and the released weights as FP8 with 128x128 block scales (`weight_scale_inv`), which import
dequantizes. CLI: `python -m model.hf import HF_DIR OUT_DIR` and `python -m model.hf export IN_DIR
HF_DIR`, where IN_DIR/OUT_DIR are native weight folders (see `model.weights`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
import re
from pathlib import Path

import torch
from safetensors import safe_open

from model.args import ModelArgs
from model.transformer import DeepSeekV3
from model.weights import load_weights, save_safetensors_dir, save_weights

FP8_BLOCK = 128


class HFCheckpointError(ValueError):
    pass


def args_from_hf_config(cfg: dict) -> ModelArgs:
    """ModelArgs from an HF `config.json` dict (legacy `rope_scaling` or v5 `rope_parameters`)."""
    if cfg.get("norm_topk_prob") is False and cfg.get("scoring_func", "sigmoid") == "sigmoid":
        raise HFCheckpointError("config.json: norm_topk_prob=false with sigmoid scores is not supported")
    if cfg.get("moe_layer_freq", 1) != 1:
        raise HFCheckpointError("config.json: moe_layer_freq != 1 is not supported")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise HFCheckpointError(f"config.json: rope type {rope_type!r} is not supported (default or yarn)")
    moe_hidden = cfg["moe_intermediate_size"]
    defaults = ModelArgs()
    return ModelArgs(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_attention_heads=cfg["num_attention_heads"],
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_head_dim=cfg["qk_nope_head_dim"],
        qk_pos_emb_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        num_moe_experts=cfg["n_routed_experts"],
        moe_ffn_hidden_size=moe_hidden,
        moe_shared_expert_intermediate_size=moe_hidden * (cfg.get("n_shared_experts") or 0),
        moe_router_topk=cfg["num_experts_per_tok"],
        moe_router_num_groups=cfg.get("n_group") or 1,
        moe_router_group_topk=cfg.get("topk_group") or 1,
        moe_router_topk_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
        moe_router_score_function=cfg.get("scoring_func", "sigmoid"),
        moe_router_enable_expert_bias=cfg.get("topk_method", "noaux_tc") == "noaux_tc",
        first_k_dense_replace=cfg.get("first_k_dense_replace", 0),
        mtp_num_layers=cfg.get("num_nextn_predict_layers", 0),
        rotary_base=rope.get("rope_theta", cfg.get("rope_theta", defaults.rotary_base)),
        rope_type="yarn" if rope_type == "yarn" else "rope",
        rotary_scaling_factor=rope.get("factor", defaults.rotary_scaling_factor),
        original_max_position_embeddings=rope.get("original_max_position_embeddings",
                                                  defaults.original_max_position_embeddings),
        max_position_embeddings=cfg.get("max_position_embeddings", defaults.max_position_embeddings),
        beta_fast=rope.get("beta_fast", defaults.beta_fast),
        beta_slow=rope.get("beta_slow", defaults.beta_slow),
        mscale=rope.get("mscale", 0.0),
        mscale_all_dim=rope.get("mscale_all_dim", 0.0),
        norm_epsilon=cfg.get("rms_norm_eps", defaults.norm_epsilon),
        vocab_size=cfg["vocab_size"],
        init_method_std=cfg.get("initializer_range", defaults.init_method_std),
    )


def hf_config_from_args(args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict:
    """An HF `config.json` dict (legacy rope keys, which every transformers version reads)."""
    if args.moe_shared_expert_intermediate_size % args.moe_ffn_hidden_size:
        raise HFCheckpointError("moe_shared_expert_intermediate_size must be a multiple of moe_ffn_hidden_size "
                                "for the HF format (n_shared_experts)")
    rope_scaling = None
    if args.rope_type == "yarn":
        rope_scaling = {"type": "yarn", "rope_type": "yarn", "factor": args.rotary_scaling_factor,
                        "original_max_position_embeddings": args.original_max_position_embeddings,
                        "beta_fast": args.beta_fast, "beta_slow": args.beta_slow,
                        "mscale": args.mscale, "mscale_all_dim": args.mscale_all_dim}
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.ffn_hidden_size,
        "moe_intermediate_size": args.moe_ffn_hidden_size,
        "num_hidden_layers": args.num_layers,
        "num_nextn_predict_layers": args.mtp_num_layers,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_attention_heads,
        "n_shared_experts": args.moe_shared_expert_intermediate_size // args.moe_ffn_hidden_size,
        "n_routed_experts": args.num_moe_experts,
        "routed_scaling_factor": args.moe_router_topk_scaling_factor,
        "kv_lora_rank": args.kv_lora_rank,
        "q_lora_rank": args.q_lora_rank,
        "qk_rope_head_dim": args.qk_pos_emb_head_dim,
        "v_head_dim": args.v_head_dim,
        "qk_nope_head_dim": args.qk_head_dim,
        "topk_method": "noaux_tc" if args.moe_router_enable_expert_bias else "greedy",
        "n_group": args.moe_router_num_groups,
        "topk_group": args.moe_router_group_topk,
        "num_experts_per_tok": args.moe_router_topk,
        "moe_layer_freq": 1,
        "first_k_dense_replace": args.first_k_dense_replace,
        "norm_topk_prob": True,
        "scoring_func": args.moe_router_score_function,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_position_embeddings,
        "initializer_range": args.init_method_std,
        "rms_norm_eps": args.norm_epsilon,
        "rope_theta": args.rotary_base,
        "rope_scaling": rope_scaling,
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _hf_layer_name(ours: str, args: ModelArgs) -> str:
    """Our name inside a decoder layer or MTP module -> the HF name (experts handled elsewhere)."""
    match = re.fullmatch(r"mtp\.(\d+)\.(.+)", ours)
    if match is None:
        return "model." + ours
    layer = f"model.layers.{args.num_layers + int(match.group(1))}."
    rest = match.group(2)
    if rest.startswith("block."):
        return layer + rest[len("block."):]
    if rest == "final_norm.weight":
        return layer + "shared_head.norm.weight"
    return layer + rest


def to_hf_state_dict(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> HF on-disk names (per-expert tensors, MTP as extra layers with copies)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name == "lm_head.weight":
            out[name] = tensor
            continue
        expert = re.fullmatch(r"(.+\.mlp\.experts)\.(gate_up_proj|down_proj)\.weight", name)
        if expert is None:
            out[_hf_layer_name(name, args)] = tensor
            continue
        prefix = _hf_layer_name(expert.group(1), args)
        for e in range(tensor.shape[0]):
            if expert.group(2) == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
    for k in range(args.mtp_num_layers):
        layer = f"model.layers.{args.num_layers + k}."
        out[layer + "embed_tokens.weight"] = state["embed_tokens.weight"].clone()
        out[layer + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    return {name: t.contiguous() for name, t in out.items()}


def _dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return weight.float() * scale


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder's *.safetensors files, with FP8 block-scaled weights dequantized."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise HFCheckpointError(f"{path}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                tensors[key] = handle.get_tensor(key)
    for key in [k for k in tensors if k.endswith(".weight_scale_inv")]:
        weight_key = key.removesuffix("_scale_inv")
        tensors[weight_key] = _dequantize_fp8(tensors[weight_key], tensors.pop(key))
    return tensors


def from_hf_state_dict(hf: dict[str, torch.Tensor], model: DeepSeekV3) -> dict[str, torch.Tensor]:
    """HF tensors -> our state dict for `model`; lists every missing, mis-shaped or unknown tensor."""
    args = model.args
    hf = dict(hf)
    ours: dict[str, torch.Tensor] = {}
    missing, misshaped = [], []
    for name, target in model.state_dict().items():
        expert = re.fullmatch(r"(.+\.mlp\.experts)\.(gate_up_proj|down_proj)\.weight", name)
        if expert is None:
            hf_name = "lm_head.weight" if name == "lm_head.weight" else _hf_layer_name(name, args)
            tensor = hf.pop(hf_name, None)
            if tensor is None:
                missing.append(hf_name)
                continue
        else:
            prefix, kind = _hf_layer_name(expert.group(1), args), expert.group(2)
            tensor = _gather_experts(hf, prefix, kind, target.shape[0], missing)
            hf_name = f"{prefix}.*.{kind}"
            if tensor is None:
                continue
        if tensor.shape != target.shape:
            misshaped.append(f"{hf_name}: checkpoint {tuple(tensor.shape)} vs model {tuple(target.shape)}")
            continue
        ours[name] = tensor.to(target.dtype)
    for k in range(args.mtp_num_layers):
        for shared in ("embed_tokens.weight", "shared_head.head.weight"):
            hf.pop(f"model.layers.{args.num_layers + k}.{shared}", None)
    unexpected = sorted(hf)
    if missing or misshaped or unexpected:
        lines = [f"missing: {n}" for n in missing] + [f"mis-shaped: {n}" for n in misshaped]
        lines += [f"unexpected: {n}" for n in unexpected]
        raise HFCheckpointError("HF checkpoint does not match the model:\n  " + "\n  ".join(lines))
    return ours


def _gather_experts(hf: dict, prefix: str, kind: str, num_experts: int, missing: list) -> torch.Tensor | None:
    packed = hf.pop(f"{prefix}.{kind}", None)
    if packed is not None:
        return packed
    parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
    stacked = []
    for e in range(num_experts):
        names = [f"{prefix}.{e}.{part}.weight" for part in parts]
        absent = [n for n in names if n not in hf]
        if absent:
            missing.extend(absent)
            continue
        stacked.append(torch.cat([hf.pop(n) for n in names], dim=0))
    return torch.stack(stacked) if len(stacked) == num_experts else None


def _mtp_layers_present(tensors: dict[str, torch.Tensor], args: ModelArgs) -> int:
    count = 0
    while count < args.mtp_num_layers and f"model.layers.{args.num_layers + count}.eh_proj.weight" in tensors:
        count += 1
    return count


def load_hf_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32) -> DeepSeekV3:
    """Build our model from an HF DeepSeek-V3 folder (config.json + safetensors)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise HFCheckpointError(f"{config_file}: not found")
    args = args_from_hf_config(json.loads(config_file.read_text()))
    problems = args.validate()
    if problems:
        raise HFCheckpointError(f"{config_file}: " + "; ".join(f"{k}: {m}" for k, m in problems))
    tensors = read_safetensors_dir(path)
    present = _mtp_layers_present(tensors, args)
    if present < args.mtp_num_layers:
        warnings.warn(f"{path}: config.json declares {args.mtp_num_layers} MTP layer(s) but the weights hold "
                      f"{present} (transformers does not save them); building the model with {present}")
        args = dataclasses.replace(args, mtp_num_layers=present)
    with torch.device("meta"):
        model = DeepSeekV3(args)
    state = from_hf_state_dict(tensors, model)
    model = model.to_empty(device="cpu")
    model.load_state_dict(state, strict=False)
    model.rotary = type(model.rotary)(args)
    return model.to(dtype) if dtype != torch.float32 else model


def save_hf_checkpoint(model: DeepSeekV3, path: str | Path, dtype: torch.dtype | None = None,
                       max_shard_bytes: int = 5 * 2**30) -> None:
    """Write config.json + (sharded) safetensors in the HF layout; atomic: the folder appears whole."""
    state = {k: v.detach().to(dtype or v.dtype).cpu() for k, v in model.state_dict().items()}
    hf = to_hf_state_dict(state, model.args)
    config = hf_config_from_args(model.args, dtype or next(model.parameters()).dtype)
    save_safetensors_dir(hf, Path(path), {"config.json": json.dumps(config, indent=2)}, max_shard_bytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.hf", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF DeepSeek-V3 folder -> native weight folder")
    imp.add_argument("hf_dir")
    imp.add_argument("out_dir")
    exp = sub.add_parser("export", help="native weight folder -> HF DeepSeek-V3 folder")
    exp.add_argument("in_dir")
    exp.add_argument("hf_dir")
    exp.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    opts = parser.parse_args(argv)
    try:
        if opts.command == "import":
            save_weights(load_hf_checkpoint(opts.hf_dir), opts.out_dir)
            print(f"imported {opts.hf_dir} -> {opts.out_dir}")
        else:
            dtype = getattr(torch, opts.dtype) if opts.dtype else None
            save_hf_checkpoint(load_weights(opts.in_dir), opts.hf_dir, dtype)
            print(f"exported {opts.in_dir} -> {opts.hf_dir}")
    except (HFCheckpointError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
