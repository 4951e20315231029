"""The Hugging Face DeepSeek-V3 layout: config.json <-> ModelArgs, and our tensor names -> HF names.

On disk the HF layout stores routed experts per expert (`mlp.experts.{e}.{gate,up,down}_proj`) and
MTP depth k as decoder layer `num_layers + k - 1` (with copies of the shared embedding and head).
Names here are those of `parallel.sharded_state.model_state`: experts split per global expert id
(`<name>.expert_<e>`), so a rank's (expert- or pipeline-sharded) state maps on its own.
"""
from __future__ import annotations

import re

import torch

from model.args import ModelArgs

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


def hf_config_from_args(args: ModelArgs, dtype: torch.dtype = torch.float32, eod_id: int | None = None) -> dict:
    """An HF `config.json` dict (legacy rope keys, which every transformers version reads). `eod_id`: the
    tokenizer's end-of-document id, which is both BOS and EOS (documents are only separated by it)."""
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
        "bos_token_id": eod_id,
        "eos_token_id": eod_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _hf_layer_name(ours: str, args: ModelArgs) -> str:
    """Our name inside a decoder layer or MTP module -> the HF name."""
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


# Shared tensors (ours) that DeepSeek-V3 checkpoints repeat in each MTP layer, under their name there.
MTP_COPIES = {"embed_tokens.weight": "embed_tokens.weight", "lm_head.weight": "shared_head.head.weight"}
_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(gate_up_proj|down_proj)\.weight\.expert_(\d+)")


def hf_items(state: dict[str, torch.Tensor], args: ModelArgs, mtp_copies: bool) -> dict[str, torch.Tensor]:
    """HF name -> view of the tensor in `state` (keyed as `model_state`), so DCP reads into or writes from
    the live tensors. `mtp_copies`: also the MTP layers' copies of the embedding and head (written by an
    export, as copies: safetensors refuses tensors sharing memory; a load takes the shared tensors once)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        expert = _EXPERT.fullmatch(name)
        if name == "lm_head.weight":
            out[name] = tensor
        elif expert is None:
            out[_hf_layer_name(name, args)] = tensor
        else:
            prefix = f"{_hf_layer_name(expert.group(1), args)}.{expert.group(3)}"
            if expert.group(2) == "down_proj":
                out[f"{prefix}.down_proj.weight"] = tensor
            else:
                gate, up = tensor.chunk(2, dim=0)
                out[f"{prefix}.gate_proj.weight"], out[f"{prefix}.up_proj.weight"] = gate, up
        if mtp_copies and name in MTP_COPIES:
            for k in range(args.mtp_num_layers):
                out[f"model.layers.{args.num_layers + k}.{MTP_COPIES[name]}"] = tensor.clone()  # safetensors
    return out

