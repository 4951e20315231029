"""What each pipeline stage holds: layers, parameters (dense / routed experts) and activations.

Stage split: the decoder layers, then the MTP depths, then the head count as units, cut into
contiguous stages as evenly as possible, the longer stages first; the embedding sits on stage 0,
the final norm, head and MTP on the last stage. Parameters come from the real modules built on
the meta device (no memory), so they are independent of model/flops.py's closed forms.

Activation estimate, elements saved for backward per token (no recomputation, flash attention),
term by term as our model code saves them (checked against the tensors autograd actually saves in
tests/unit/test_plan.py); d hidden, H heads, q/kv LoRA ranks ql/kl, rope dim r, qk = nope + r,
vd = v head dim:
- attention block: 2d+1 (input norm: input, rstd, output) + 3 ql+1 (q LoRA and its norm)
  + kl+r + 2 kl+1 (kv LoRA and its norm) + r (rope tables) + 4 H qk + H (q, k, v padded to qk,
  output and log-sum-exp) + H vd (o_proj input);
- post-attention norm: 3d+1;
- dense FFN: 4 f (gate, up, SiLU, product);
- MoE FFN with E experts, top-k, expert width f, shared width fs: E + 3.25k + 2 (router scores,
  indices, weights, mask, combine weights) + 4k (int64 permutations) + 2kd (two permuted copies of the expert input)
  + 5kf + k (grouped GEMM inputs/outputs and SwiGLU) + 4 fs (shared expert);
- stage input: d; head: 2d+1 (final norm) + 2V (logits and log-probabilities);
- each MTP depth: two input norms 2(2d+1), the concatenated projection input 2d, one MoE layer,
  a final norm 2d+1 and a head 2V.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from model.args import ModelArgs
from model.transformer import DeepSeekV3
from parallel.data_parallel import is_expert_parameter


@dataclass(frozen=True)
class Stage:
    """One model chunk: which parts it holds and its parameter and activation sizes."""

    index: int
    layers: range
    embedding: bool
    head: bool  # final norm, LM head and the MTP depths
    dense_params: int
    expert_params: int  # all routed experts of its MoE layers (divide by ep for one rank)
    moe_layers: int
    activations_per_token: int  # elements saved for backward per token of one micro-batch


def split_units(num_units: int, num_stages: int) -> list[range]:
    """Contiguous, as-even-as-possible ranges of units, the longer ones first."""
    base, extra = divmod(num_units, num_stages)
    bounds, start = [], 0
    for stage in range(num_stages):
        stop = start + base + (stage < extra)
        bounds.append(range(start, stop))
        start = stop
    return bounds


def _attention_elements(a: ModelArgs) -> int:
    d, heads, r = a.hidden_size, a.num_attention_heads, a.qk_pos_emb_head_dim
    q = 3 * a.q_lora_rank + 1 if a.q_lora_rank is not None else 0
    kv = a.kv_lora_rank + r + 2 * a.kv_lora_rank + 1
    return 2 * d + 1 + q + kv + r + 4 * heads * a.qk_full_head_dim + heads + heads * a.v_head_dim


def _moe_elements(a: ModelArgs) -> float:
    d, k, f = a.hidden_size, a.moe_router_topk, a.moe_ffn_hidden_size
    return (a.num_moe_experts + 3.25 * k + 2 + 4 * k + 2 * k * d + 5 * k * f + k
            + 4 * a.moe_shared_expert_intermediate_size)


def layer_activation_elements(a: ModelArgs, moe: bool) -> int:
    """Elements saved for backward per token by one decoder layer (see the module docstring)."""
    ffn = _moe_elements(a) if moe else 4 * a.ffn_hidden_size
    return round(_attention_elements(a) + 3 * a.hidden_size + 1 + ffn)


def head_activation_elements(a: ModelArgs) -> int:
    """Final norm and head, plus every MTP depth, per token."""
    d, vocab = a.hidden_size, a.vocab_size
    head = 2 * d + 1 + 2 * vocab
    mtp = 2 * (2 * d + 1) + 2 * d + layer_activation_elements(a, moe=a.num_moe_experts > 0) + head
    return head + a.mtp_num_layers * mtp


def _module_parameters(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(dense, routed-expert) parameter counts per top-level part: 'embed', 'layers.i', 'head'."""
    with torch.device("meta"):
        model = DeepSeekV3(args)
    counts: dict[str, list[int]] = {}
    for name, param in model.named_parameters():
        if name.startswith("layers."):
            part = ".".join(name.split(".")[:2])
        elif name.startswith("embed_tokens."):
            part = "embed"
        else:
            part = "head"
        entry = counts.setdefault(part, [0, 0])
        entry[is_expert_parameter(name)] += param.numel()
    return {part: (dense, expert) for part, (dense, expert) in counts.items()}


def build_stages(args: ModelArgs, num_stages: int) -> list[Stage]:
    """The model cut into `num_stages` chunks (see the module docstring for the rule)."""
    units = args.num_layers + args.mtp_num_layers + 1
    if units < num_stages:
        raise ValueError(f"{args.num_layers} layers, {args.mtp_num_layers} MTP depths and the head "
                         f"cannot fill {num_stages} pipeline stages")
    params = _module_parameters(args)
    mtp_moe = args.mtp_num_layers if args.num_moe_experts > 0 else 0
    stages = []
    for index, unit_range in enumerate(split_units(units, num_stages)):
        layers = range(unit_range.start, min(unit_range.stop, args.num_layers))
        head = index == num_stages - 1
        parts = [f"layers.{i}" for i in layers] + ["embed"] * (index == 0) + ["head"] * head
        moe_layers = sum(args.is_moe_layer(i) for i in layers)
        activations = args.hidden_size + sum(layer_activation_elements(args, args.is_moe_layer(i)) for i in layers)
        if head:
            activations += head_activation_elements(args)
        stages.append(Stage(
            index=index, layers=layers, embedding=index == 0, head=head,
            dense_params=sum(params[p][0] for p in parts), expert_params=sum(params[p][1] for p in parts),
            moe_layers=moe_layers + mtp_moe * head, activations_per_token=activations))
    return stages


def embedding_parameters(args: ModelArgs) -> int:
    return args.vocab_size * args.hidden_size
