"""Closed-form parameter counts and training FLOPs per token (for MFU).

Training FLOPs = 3 x forward, 2 FLOPs per multiply-accumulate:
F = 6 * N_act,mm + 6 * L * heads * (qk_dim + v_dim) * S / 2 (causal), where N_act,mm is the
activated parameter count without the embedding lookup (the LM head is counted). Each MTP depth
adds its activated parameters, one more head GEMM and one more attention.
Router correction biases are buffers, not parameters, and are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass

from model.args import ModelArgs


@dataclass(frozen=True)
class ParameterCounts:
    total: int  # main model: embedding + layers + final norm + head
    activated: int  # per token, main model, embedding included
    mtp_total: int  # MTP modules, without the shared embedding and head
    mtp_activated: int

    @property
    def total_with_mtp(self) -> int:
        return self.total + self.mtp_total


def _attention_params(a: ModelArgs) -> int:
    d, heads = a.hidden_size, a.num_attention_heads
    qk = a.qk_full_head_dim
    q = d * heads * qk if a.q_lora_rank is None else d * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * heads * qk
    kv = d * (a.kv_lora_rank + a.qk_pos_emb_head_dim) + a.kv_lora_rank + a.kv_lora_rank * heads * (
        a.qk_head_dim + a.v_head_dim)
    return q + kv + heads * a.v_head_dim * d


def _moe_params(a: ModelArgs, experts: int) -> int:
    d = a.hidden_size
    return a.num_moe_experts * d + experts * 3 * d * a.moe_ffn_hidden_size + 3 * d * a.moe_shared_expert_intermediate_size


def _layer_params(a: ModelArgs, moe: bool, activated: bool) -> int:
    d = a.hidden_size
    ffn = 3 * d * a.ffn_hidden_size
    if moe:
        ffn = _moe_params(a, a.moe_router_topk if activated else a.num_moe_experts)
    return 2 * d + _attention_params(a) + ffn


def count_parameters(a: ModelArgs) -> ParameterCounts:
    d, vocab = a.hidden_size, a.vocab_size
    outer = 2 * vocab * d + d
    layers = [a.is_moe_layer(i) for i in range(a.num_layers)]
    mtp_outer = 2 * d * d + 3 * d
    has_moe = a.num_moe_experts > 0
    return ParameterCounts(
        total=outer + sum(_layer_params(a, moe, False) for moe in layers),
        activated=outer + sum(_layer_params(a, moe, True) for moe in layers),
        mtp_total=a.mtp_num_layers * (mtp_outer + _layer_params(a, has_moe, False)),
        mtp_activated=a.mtp_num_layers * (mtp_outer + _layer_params(a, has_moe, True)),
    )


def training_flops_per_token(a: ModelArgs, seq_length: int, with_mtp: bool = False, causal: bool = True) -> float:
    """Training FLOPs per token at sequence length `seq_length` (see module docstring)."""
    counts = count_parameters(a)
    head = a.vocab_size * a.hidden_size
    attention = 6 * a.num_attention_heads * (a.qk_full_head_dim + a.v_head_dim) * seq_length
    if causal:
        attention /= 2
    flops = 6 * (counts.activated - head) + a.num_layers * attention
    if with_mtp:
        flops += 6 * (counts.mtp_activated + a.mtp_num_layers * head) + a.mtp_num_layers * attention
    return flops
