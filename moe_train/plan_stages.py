"""What each pipeline stage holds: layers, parameters (dense / routed experts) and activations.

Stage split: the decoder layers, then the MTP depths, then the head count as units, cut into
contiguous stages as evenly as possible, the longer stages first; the embedding sits on stage 0,
the final norm, head and MTP on the last stage. A rank's parameters come from the trainer's model of
its stages built on the meta device (no memory), so they are independent of model/flops.py's
closed forms.

Activation memory of one decoder layer for one micro-batch of T tokens (`layer_memory`), in bytes,
as our model code allocates it (checked against the storages a real layer allocates on CPU, fp32 and
bf16, in tests/unit/test_plan.py). Per token, with d hidden, H heads, q/kv LoRA ranks ql/kl, rope dim
r, qk = nope + r, vd = v head dim and b the compute dtype's bytes (4 fp32, 2 bf16); under bf16 autocast
every Linear saves its own bf16 copy of an fp32 input, in fp32 the input itself is shared:
- attention: input norm 4 + 4d + (2 x 2d bf16 casts | 4d output); each LoRA norm of width w
  (q: ql, kv: kl) 4w (fp32 input) + 4 + 2 b w (normalised and output); fp32 also keeps the rope part
  of the kv_a output, 4r; q, k, padded v and output b 4 H qk, log-sum-exp 4H, o_proj input b H vd;
- residual and post-attention norm 4d + 4 + 4d, then the FFN input: dense (2 x 2d casts | 4d),
  MoE 4d (the router reads it in fp32) + the shared expert's casts 2 x 2d;
- dense FFN: 4 f b (gate, SiLU, up, product);
- MoE: router 4E + 12k + 4 (+ 4 with the balance loss); two int64 slot orders 16k; routed experts
  e (2kd + 5kf) + 4k, e = b (their grouped GEMMs follow autocast too); shared expert 4 fs b;
- layer output 4d (the residual stream is fp32 in both precisions).
Under bf16 autocast each forward also keeps bf16 copies of the Linear weights it used (2 bytes per
parameter per micro-batch, the routed experts' included; not the router's).
With EP > 1 the dispatch adds its receive buffers and saved ids, which are not counted.

The peak during the layer's backward adds the incoming output gradient (4d) and the gradients and
temporaries alive at once at the widest point of the FFN's backward (the block run first): for a
SwiGLU of width w, the largest of two gradients of width w, one plus the down projection's weight
gradient (d w b, and with bf16 the bf16 copy of the incoming gradient, 2d), and with bf16 an input
projection's weight gradient in bf16 and fp32 (6 d w) once two widths are freed; for the routed
experts, after the shared expert's activations are freed, the largest of their output gradient
(kd), the down projection's input and weight gradients (kf + E d f) and the gate/up projection's
(E 2 f d, with 3 kf of activations freed).
With `recompute_granularity: full` a layer keeps only 4d per token (its input) until its backward,
which first rebuilds the activations above: the peak is the same.

Outside the decoder layers: the stage input, 4d per token; the final norm, LM head and loss
(`head_memory`, also measured): the fp32 log-probabilities 4V and the norm kept, the head's bf16
weight copy, and in backward the gradients of log-probabilities and logits, 8V; each MTP depth
(`mtp_memory`, not measured; the same rules): its embedding and hidden norms, projection input,
final norm and head, besides its decoder layer. Recomputation covers the decoder layers only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from model.args import ModelArgs
from model.transformer import DeepSeekV3, ModelPart
from parallel.data_parallel import is_expert_parameter


@dataclass(frozen=True)
class Stage:
    """One model chunk: which parts it holds and its parameter counts."""

    index: int
    layers: range
    embedding: bool
    head: bool  # final norm, LM head and the MTP depths
    moe_layers: int


def split_units(num_units: int, num_stages: int) -> list[range]:
    """Contiguous, as-even-as-possible ranges of units, the longer ones first."""
    base, extra = divmod(num_units, num_stages)
    bounds, start = [], 0
    for stage in range(num_stages):
        stop = start + base + (stage < extra)
        bounds.append(range(start, stop))
        start = stop
    return bounds


def _expert_bytes(bf16: bool) -> int:
    """Bytes per element the routed experts keep: their grouped GEMMs follow autocast (GemmOps.grouped)."""
    return 2 if bf16 else 4


@dataclass(frozen=True)
class LayerMemory:
    """One decoder layer's memory for one micro-batch, in bytes (parameters and their gradients excluded)."""

    kept: float  # allocated by its forward and held until its backward (without recomputation)
    peak: float  # the most alive at once during its forward and backward


def _ffn_input_bytes(d: int, bf16: bool) -> int:
    """What the two input projections of a SwiGLU keep of an fp32 input: two bf16 casts, or the input."""
    return 2 * 2 * d if bf16 else 4 * d


def _attention_bytes(a: ModelArgs, bf16: bool) -> int:
    d, heads, r, b = a.hidden_size, a.num_attention_heads, a.qk_pos_emb_head_dim, 2 if bf16 else 4
    low_rank_norm = lambda width: 4 * width + 4 + 2 * b * width  # noqa: E731
    q = low_rank_norm(a.q_lora_rank) if a.q_lora_rank is not None else 0
    kv = low_rank_norm(a.kv_lora_rank) + (0 if bf16 else 4 * r)
    core = b * (4 * heads * a.qk_full_head_dim + heads * a.v_head_dim) + 4 * heads
    return 4 + 4 * d + _ffn_input_bytes(d, bf16) + q + kv + core


def _shared_expert_kept(a: ModelArgs, bf16: bool) -> int:
    fs = a.moe_shared_expert_intermediate_size
    return (4 * fs * (2 if bf16 else 4) + 2 * 2 * a.hidden_size * bf16) if fs else 0


def _kept_per_token(a: ModelArgs, moe: bool, bf16: bool) -> float:
    d, b = a.hidden_size, 2 if bf16 else 4
    common = _attention_bytes(a, bf16) + (4 * d + 4 + 4 * d) + 4 * d  # + residual, post norm, layer output
    if not moe:
        return common + _ffn_input_bytes(d, bf16) + 4 * a.ffn_hidden_size * b
    k, f = a.moe_router_topk, a.moe_ffn_hidden_size
    router = 4 * a.num_moe_experts + 12 * k + 4 * (a.moe_router_score_function == "sigmoid" and k > 1) \
        + 4 * (a.moe_aux_loss_coeff > 0)
    experts = _expert_bytes(bf16) * (2 * k * d + 5 * k * f) + 4 * k
    return common + 4 * d + router + 16 * k + experts + _shared_expert_kept(a, bf16)


def _cast_weights(a: ModelArgs, moe: bool, local_experts: int) -> int:
    """Parameters that autocast casts to bf16 at every forward: the Linear modules' and the routed experts'."""
    d, heads, r = a.hidden_size, a.num_attention_heads, a.qk_pos_emb_head_dim
    qk = heads * a.qk_full_head_dim
    q = d * qk if a.q_lora_rank is None else a.q_lora_rank * (d + qk)
    kv = d * (a.kv_lora_rank + r) + a.kv_lora_rank * heads * (a.qk_head_dim + a.v_head_dim)
    ffn = 3 * d * (a.moe_shared_expert_intermediate_size if moe else a.ffn_hidden_size)
    routed = 3 * d * a.moe_ffn_hidden_size * local_experts if moe else 0
    return q + kv + heads * a.v_head_dim * d + ffn + routed


def _swiglu_backward(d: int, width: int, tokens: int, bf16: bool) -> float:
    b = 2 if bf16 else 4
    weight_grads = 6 * d * width - width * b * tokens if bf16 else 0  # bf16 and fp32 copies, 2 of 4 widths freed
    return max(2 * width * b * tokens, (width * b + 2 * d * bf16) * tokens + d * width * b, weight_grads)


def layer_memory(a: ModelArgs, moe: bool, tokens: int, precision: str, local_experts: int | None = None) -> LayerMemory:
    """Bytes of one decoder layer for one micro-batch of `tokens` (see the module docstring);
    `local_experts`: routed experts on this rank (default all)."""
    bf16, d = precision == "bf16", a.hidden_size
    experts = a.num_moe_experts if local_experts is None else local_experts
    kept = _kept_per_token(a, moe, bf16) * tokens + 2 * _cast_weights(a, moe, experts) * bf16
    output_grad = 4 * d * tokens  # the gradient the layer above hands down, alive through the backward
    if not moe:
        return LayerMemory(kept, kept + output_grad + _swiglu_backward(d, a.ffn_hidden_size, tokens, bf16))
    k, f, fs = a.moe_router_topk, a.moe_ffn_hidden_size, a.moe_shared_expert_intermediate_size
    shared = _swiglu_backward(d, fs, tokens, bf16) if fs else 0.0
    # the shared expert's backward runs first and frees its activations (and weight copies); its
    # input gradient (fp32, 4d) stays for the routed experts' to be added
    freed = (_shared_expert_kept(a, bf16) - 4 * d) * tokens + 2 * 3 * d * fs * bf16
    e = _expert_bytes(bf16)
    routed = max(k * d * e * tokens, k * f * e * tokens + experts * d * f * e,
                 -3 * k * f * e * tokens + experts * 2 * f * d * e) - freed
    return LayerMemory(kept, kept + output_grad + max(shared, routed))


def head_memory(a: ModelArgs, tokens: int, precision: str) -> LayerMemory:
    """Final norm, LM head and cross-entropy for one micro-batch: the fp32 log-probabilities (4V per
    token) and the norm are kept; backward adds the gradients of the log-probabilities and logits."""
    bf16, d, vocab = precision == "bf16", a.hidden_size, a.vocab_size
    norm = 4 + 4 * d + (2 * d if bf16 else 4 * d)
    kept = (4 * vocab + norm) * tokens + 2 * d * vocab * bf16
    return LayerMemory(kept, kept + 8 * vocab * tokens)


def mtp_memory(a: ModelArgs, tokens: int, precision: str) -> LayerMemory:
    """One MTP depth without its decoder layer (not measured; the same rules): the embedding and
    hidden norms, the concatenated projection input, the layer output's final norm and the head."""
    bf16, d = precision == "bf16", a.hidden_size
    norms = 2 * (4 + 4 * d + 4 * d) + (2 * 2 * d if bf16 else 8 * d) + 4 * d  # + concat (or its cast), output
    head = head_memory(a, tokens, precision)
    weights = 2 * 2 * d * d * bf16  # eh_proj's bf16 copy; the head's comes with head_memory
    return LayerMemory(head.kept + norms * tokens + weights, head.peak + norms * tokens + weights)


def build_stages(args: ModelArgs, num_stages: int) -> list[Stage]:
    """The model cut into `num_stages` chunks (see the module docstring for the rule)."""
    units = args.num_layers + args.mtp_num_layers + 1
    if units < num_stages:
        raise ValueError(f"{args.num_layers} layers, {args.mtp_num_layers} MTP depths and the head "
                         f"cannot fill {num_stages} pipeline stages")
    mtp_moe = args.mtp_num_layers if args.num_moe_experts > 0 else 0
    stages = []
    for index, unit_range in enumerate(split_units(units, num_stages)):
        layers = range(unit_range.start, min(unit_range.stop, args.num_layers))
        head = index == num_stages - 1
        moe_layers = sum(args.is_moe_layer(i) for i in layers)
        stages.append(Stage(index=index, layers=layers, embedding=index == 0, head=head,
                            moe_layers=moe_layers + mtp_moe * head))
    return stages


def rank_parameters(args: ModelArgs, stages: list[Stage], ep: int) -> tuple[list[int], list[int]]:
    """Sizes of the dense and the routed-expert parameter tensors (one EP rank's share) of a pipeline
    rank holding `stages`, in the order of the trainer's model (built for those parts on the meta
    device), which is the order ZeRO-1 deals them out in."""
    parts = [ModelPart(tuple(s.layers), embedding=s.embedding, head=s.head) for s in stages]
    with torch.device("meta"):
        model = DeepSeekV3(args, parts=parts)
    dense, expert = [], []
    for name, param in model.named_parameters():
        if is_expert_parameter(name):
            expert.append(param.numel() // ep)
        else:
            dense.append(param.numel())
    return dense, expert
