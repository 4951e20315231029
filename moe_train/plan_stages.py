"""What each pipeline stage holds: layers, parameters (dense / routed experts) and activations.

Stage split: the trainer's (parallel.pipeline.stage.stage_specs: `parallel.pipeline_layout`, or
`first_stage_layers` / `last_stage_layers` and the rest evenly); the embedding sits on stage 0, the
final norm, head and MTP on the last stage. A rank's parameters come from the trainer's model of
its stages built on the meta device (no memory), so they are independent of model/flops.py's
closed forms.

Activation memory of one decoder layer for one micro-batch of T tokens (`layer_memory`), in bytes,
as our model code allocates it (checked against the storages a real layer allocates on CPU, fp32 and
with bf16 parameters, in tests/unit/test_plan.py). Per token, with d hidden, H heads, q/kv LoRA ranks
ql/kl, rope dim r, qk = nope + r, vd = v head dim and b the bytes of the parameters' dtype (4 fp32,
2 with train.precision=bf16: parallel.mixed_precision's bf16 parameters, so the residual stream,
every GEMM's output and what a Linear saves of its input are bf16). An RMSNorm of width w keeps
4 (its fp32 statistics) + b w (the normalised input) and, with bf16 parameters, 4w: the fp32 copy
of its input it normalises (in fp32 that is the input itself):
- attention: the input norm, its output b d (the q_a and kv_a projections' input); each LoRA norm of
  width w (q: ql, kv: kl) with its output b w and, in fp32, its input 4w; fp32 also keeps the rope
  part of the kv_a output, 4r; q, k, padded v and output b 4 H qk, log-sum-exp 4H, o_proj input b H vd;
- the residual 4d (fp32: the residual itself, bf16: the post-attention norm's copy) and that norm's
  4 + b d, then the FFN input: dense b d, MoE 4d (the router's fp32 input) and with bf16 parameters
  the norm's output 2d (the shared expert's input);
- dense FFN: 4 f b (gate, SiLU, up, product);
- MoE: router 4E + 12k + 4 (+ 4 with the balance loss); two int64 slot orders 16k; routed experts
  b (2kd + 5kf + k); shared expert 4 fs b; with bf16 parameters the router's fp32 copy of its gate
  weight, 4 E d per micro-batch (no other weight is copied);
- layer output b d.
With EP > 1 the dispatch adds its receive buffers and saved ids, which are not counted.

The peak during the layer's backward is the larger of two phases. The FFN's (run first) adds the
incoming output gradient (b d) and the gradients and temporaries alive at once at the widest point
of the FFN's backward: for a SwiGLU of width w, the larger of two gradients of width w and one plus
the down projection's weight gradient (d w b); for the routed experts, after the shared expert's
activations are freed, the largest of their output gradient (kd), the down projection's input and
weight gradients (kf + E d f) and the gate/up projection's (E 2 f d, with 3 kf of activations
freed). The attention's, once the FFN half is freed: the attention half's bytes, the layer's
output, the incoming gradient and the residual's gradient (b d each) and the core's gradients,
b H (3 qk + r).

`recompute_modules` (model/recompute.py), each term measured as the code allocates it:
- `full`: a layer keeps only b d per token (its input) until its backward, which first rebuilds all
  of the above: the peak is the same.
- the selective modules take off what `recompute_savings` lists (each norm's statistics,
  normalised input, output and fp32 copy; q, k and v; the experts' SiLU, product and scaled
  product), net of the region inputs they keep, and add what their backward rebuilds to the phase
  that rebuilds it: q, k and v (and with layernorm the latents) to the attention's, the experts'
  activation and the post-attention norm's output to the FFN's.

Outside the decoder layers: the stage input, b d per token; the final norm, LM head and loss
(`head_memory`, also measured): the fp32 log-probabilities 4V and the norm kept, and in backward the
gradients of log-probabilities and logits, 8V; each MTP depth (`mtp_memory`): its embedding and
hidden norms, projection input and output, final norm and head, besides its decoder layer.
Recomputation covers the decoder layers only. A stage (`stage_activation_bytes`) sums these and,
with bf16 parameters, leaves out the hidden states that only norms read (`unkept_hidden_states`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from model.args import FULL_RECOMPUTE, ModelArgs
from model.transformer import DeepSeekV3, ModelPart
from parallel.data_parallel import is_expert_parameter
from parallel.pipeline.replicas import EMBEDDING
from parallel.pipeline.stage import stage_specs


@dataclass(frozen=True)
class Stage:
    """One model chunk: which parts it holds and its parameter counts."""

    index: int
    layers: range
    embedding: bool
    head: bool  # final norm, LM head and the MTP depths
    moe_layers: int


@dataclass(frozen=True)
class LayerMemory:
    """One decoder layer's memory for one micro-batch, in bytes (parameters and their gradients excluded)."""

    kept: float  # allocated by its forward and held until its backward
    peak: float  # the most alive at once during its forward and backward


def _dtype_bytes(bf16: bool) -> int:
    """b: bytes per element of the parameters' dtype, which the activations take too."""
    return 2 if bf16 else 4


def _norm_bytes(width: int, bf16: bool) -> int:
    """What an RMSNorm of `width` keeps besides its input and output: its statistics (4) and its
    normalised input (b w), and with bf16 parameters the fp32 copy of its bf16 input (4w) that it
    normalises (in fp32 that is the input itself)."""
    return 4 + _dtype_bytes(bf16) * width + 4 * width * bf16


def attention_terms(a: ModelArgs, bf16: bool) -> dict[str, float]:
    """Bytes per token the attention half of a layer keeps without recomputation, by what keeps them."""
    d, heads, r, b = a.hidden_size, a.num_attention_heads, a.qk_pos_emb_head_dim, _dtype_bytes(bf16)
    low_rank_norm = lambda width: _norm_bytes(width, bf16) + b * width + 4 * width * (not bf16)  # noqa: E731
    return {"input_norm": _norm_bytes(d, bf16), "attention_input": b * d,
            "q_norm": low_rank_norm(a.q_lora_rank) if a.q_lora_rank is not None else 0,
            "kv_norm": low_rank_norm(a.kv_lora_rank) + (0 if bf16 else 4 * r),
            "qkv": 3 * b * heads * a.qk_full_head_dim,
            "attention_core": b * (heads * a.qk_full_head_dim + heads * a.v_head_dim) + 4 * heads}


def _shared_expert_kept(a: ModelArgs, bf16: bool) -> int:
    """Its four activations of width fs; with bf16 parameters also its input, the post-attention norm's
    bf16 output (in fp32 that tensor is the router's input, counted there)."""
    fs = a.moe_shared_expert_intermediate_size
    return (4 * fs * _dtype_bytes(bf16) + 2 * a.hidden_size * bf16) if fs else 0


def ffn_terms(a: ModelArgs, moe: bool, bf16: bool) -> dict[str, float]:
    """The same for the rest of the layer: residual, post-attention norm, FFN and the layer output
    (the residual is kept by the post-attention norm: in fp32 itself, with bf16 parameters its fp32
    copy, 4d in both)."""
    d, b = a.hidden_size, _dtype_bytes(bf16)
    terms = {"residual": 4 * d, "post_norm": _norm_bytes(d, bf16) - 4 * d * bf16}
    if not moe:
        return {**terms, "ffn_input": b * d, "ffn": 4 * a.ffn_hidden_size * b, "output": b * d}
    k, f = a.moe_router_topk, a.moe_ffn_hidden_size
    router = 4 * a.num_moe_experts + 12 * k + 4 * (a.moe_router_score_function == "sigmoid" and k > 1) \
        + 4 * (a.moe_aux_loss_coeff > 0)
    return {**terms, "router_input": 4 * d, "router": router + 16 * k, "experts": b * (2 * k * d + k),
            "expert_activation": b * 5 * k * f, "shared_expert": _shared_expert_kept(a, bf16), "output": b * d}


def recompute_savings(a: ModelArgs, moe: bool, bf16: bool) -> dict[str, float]:
    """Bytes per token each selective module of `a.recompute_modules` no longer keeps (model/recompute.py),
    net of the region inputs it keeps instead. layernorm: each norm keeps only its input, none of
    `_norm_bytes` and not its output; with bf16 parameters the q and kv latent norms keep their bf16
    inputs (the q_a and kv_a outputs) and the post-attention norm the bf16 residual instead of their
    fp32 copies; mla_up_proj: q, k and v; moe_act: the SwiGLU's SiLU, product and scaled product (its
    gate/up input stays). With bf16 parameters either of the first two keeps the kv_a output (its
    latent and rope key, 2 (kl + r)); in fp32 the kv norm kept it already."""
    modules, d, b = set(a.recompute_modules), a.hidden_size, _dtype_bytes(bf16)
    ql, kl, heads = a.q_lora_rank, a.kv_lora_rank, a.num_attention_heads
    saved: dict[str, float] = {}
    if "layernorm" in modules:
        low_rank = lambda w: _norm_bytes(w, bf16) + b * w  # noqa: E731
        q_norm = low_rank(ql) - 2 * ql * bf16 if ql is not None else 0
        saved["layernorm_attention"] = _norm_bytes(d, bf16) + b * d + q_norm + low_rank(kl)
        # the norm's output: the FFN's input, or in a MoE layer the router's fp32 input (fp32) or the
        # shared expert's input (bf16)
        output = b * d * (not (moe and bf16) or a.moe_shared_expert_intermediate_size > 0)
        saved["layernorm_ffn"] = _norm_bytes(d, bf16) + output - 2 * d * bf16
    if "mla_up_proj" in modules:
        saved["mla_up_proj"] = 3 * b * heads * a.qk_full_head_dim
    if bf16 and modules & {"layernorm", "mla_up_proj"}:
        saved["kv_a_output"] = -2 * (kl + a.qk_pos_emb_head_dim)
    if "moe_act" in modules and moe:
        saved["moe_act"] = 3 * b * a.moe_router_topk * a.moe_ffn_hidden_size
    return saved


def _swiglu_backward(d: int, width: int, tokens: int, bf16: bool) -> float:
    b = _dtype_bytes(bf16)
    return max(2 * width * b * tokens, width * b * tokens + d * width * b)


def _ffn_backward(a: ModelArgs, moe: bool, tokens: int, bf16: bool, experts: int) -> float:
    """Gradients and temporaries alive at once at the widest point of the FFN's backward (run first)."""
    d = a.hidden_size
    if not moe:
        return _swiglu_backward(d, a.ffn_hidden_size, tokens, bf16)
    modules = set(a.recompute_modules)
    k, f, fs = a.moe_router_topk, a.moe_ffn_hidden_size, a.moe_shared_expert_intermediate_size
    shared = _swiglu_backward(d, fs, tokens, bf16) if fs else 0.0
    # the shared expert's backward runs first and frees what it kept; its input gradient (b d) stays
    # for the routed experts' to be added
    b = _dtype_bytes(bf16)
    freed = (_shared_expert_kept(a, bf16) - b * d) * tokens
    activations = k * f * b * tokens
    # moe_act: the rebuilt down-projection input is alive in its backward; the gate/up projection's
    # backward then frees none of the 3 kf (they were not kept)
    rebuilt = activations if "moe_act" in modules else 0
    unfreed = 3 * activations if "moe_act" in modules else 0
    routed = max(k * d * b * tokens, activations + experts * d * f * b + rebuilt,
                 -3 * activations + unfreed + experts * 2 * f * d * b) - freed
    # layernorm: the shared expert's backward rebuilds the post-attention norm's output; in fp32 it
    # stays until the router's backward reads it (4d), with bf16 parameters it goes (the router keeps
    # an fp32 copy) but is not among the kept bytes `freed` counts (2d)
    rebuilt_norm = b * d * tokens if "layernorm" in modules and fs else 0
    return max(shared, routed) + rebuilt_norm


def _attention_backward(a: ModelArgs, tokens: int, bf16: bool) -> float:
    """The attention core's backward: the gradients of q, k, v and of the rope keys, plus q, k and v
    rebuilt under mla_up_proj (with layernorm, also the latents they come from)."""
    modules, heads, qk = set(a.recompute_modules), a.num_attention_heads, a.qk_full_head_dim
    b = _dtype_bytes(bf16)
    work = b * heads * (3 * qk + a.qk_pos_emb_head_dim)
    if "mla_up_proj" in modules:
        work += 3 * b * heads * qk
        if "layernorm" in modules:
            work += b * ((a.q_lora_rank or a.hidden_size) + a.kv_lora_rank)
    return work * tokens


def _router_weight(a: ModelArgs, moe: bool, bf16: bool) -> int:
    """The router's fp32 copy of its bf16 gate weight, E d, which its logits' GEMM keeps per micro-batch."""
    return 4 * a.num_moe_experts * a.hidden_size * (moe and bf16)


def layer_memory(a: ModelArgs, moe: bool, tokens: int, precision: str, local_experts: int | None = None) -> LayerMemory:
    """Bytes of one decoder layer for one micro-batch of `tokens` (see the module docstring), with the
    layer's `a.recompute_modules`; `local_experts`: routed experts on this rank (default all).

    The peak is the larger of two phases of the backward: the FFN's (first), with every attention
    tensor still kept, and the attention's, after the FFN half is freed, with the layer's output,
    the incoming gradient and the gradient of the residual (b d each) alive."""
    bf16, d = precision == "bf16", a.hidden_size
    experts = a.num_moe_experts if local_experts is None else local_experts
    hidden = _dtype_bytes(bf16) * d * tokens  # one hidden state: the layer's output, or a gradient of it
    if FULL_RECOMPUTE in a.recompute_modules:  # keeps its input; the backward rebuilds all of it first
        stored = layer_memory(dataclasses.replace(a, recompute_modules=[]), moe, tokens, precision, local_experts)
        return LayerMemory(hidden, stored.peak)
    attention = sum(attention_terms(a, bf16).values())
    savings = recompute_savings(a, moe, bf16)
    ffn_saved = savings.get("layernorm_ffn", 0) + savings.get("moe_act", 0)
    attention_kept = (attention - sum(savings.values()) + ffn_saved) * tokens
    kept = attention_kept + (sum(ffn_terms(a, moe, bf16).values()) - ffn_saved) * tokens + _router_weight(a, moe, bf16)
    output_grad = hidden  # the gradient the layer above hands down, alive through the backward
    ffn_phase = kept + output_grad + _ffn_backward(a, moe, tokens, bf16, experts)
    attention_phase = attention_kept + 3 * hidden + _attention_backward(a, tokens, bf16)
    return LayerMemory(kept, max(ffn_phase, attention_phase))


def head_memory(a: ModelArgs, tokens: int, precision: str) -> LayerMemory:
    """Final norm, LM head and cross-entropy for one micro-batch: the fp32 log-probabilities (4V per
    token) and the norm with its output (the head's input) are kept; backward adds the gradients of
    the log-probabilities and logits."""
    bf16, d, vocab = precision == "bf16", a.hidden_size, a.vocab_size
    norm = _norm_bytes(d, bf16) + _dtype_bytes(bf16) * d
    kept = (4 * vocab + norm) * tokens
    return LayerMemory(kept, kept + 8 * vocab * tokens)


def mtp_memory(a: ModelArgs, tokens: int, precision: str) -> LayerMemory:
    """One MTP depth without its decoder layer: the embedding and hidden norms, their concatenated
    outputs (the projection's input), the projection's output (the layer's input), the layer output's
    final norm and the head. fp32 (not measured) also counts the embedding's output (the embedding
    norm's input, 4d) and 4d for the hidden norm's input, which the last decoder layer's output
    already counts."""
    bf16, d = precision == "bf16", a.hidden_size
    b = _dtype_bytes(bf16)
    norms = 2 * _norm_bytes(d, bf16) + 2 * b * d + b * d + 8 * d * (not bf16)
    head = head_memory(a, tokens, precision)
    return LayerMemory(head.kept + norms * tokens, head.peak + norms * tokens)


def unkept_hidden_states(a: ModelArgs, stage: Stage, precision: str) -> int:
    """How many of the hidden states that `stage_activation_bytes` counts as kept (b d per token each:
    the embedding's output, each decoder layer's output, each MTP depth's layer input) go once the
    forward moves on. In fp32 none: every reader of a hidden state is a norm that keeps its input.
    With bf16 parameters a norm keeps an fp32 copy instead, so a hidden state that only norms read
    goes: the last layer's output on the head stage and each MTP layer's output (the final norms
    read them), and a decoder layer's input unless the layer recomputes its norms (the layernorm
    region keeps its input) or itself (full: the checkpoint keeps it). A received stage input stays,
    held by the pipeline for the stage's backward."""
    if precision != "bf16":
        return 0
    depths = a.mtp_num_layers if stage.head else 0
    read_by_final_norms = (stage.head and len(stage.layers) > 0) + depths
    if set(a.recompute_modules) & {"layernorm", FULL_RECOMPUTE}:
        return read_by_final_norms
    layer_inputs = stage.embedding + max(len(stage.layers) - 1, 0) + depths
    return read_by_final_norms + layer_inputs


def stage_activation_bytes(a: ModelArgs, stage: Stage, tokens: int, precision: str,
                           local_experts: int | None = None) -> tuple[float, float]:
    """(bytes kept per micro-batch until its backward, extra bytes while one backward runs) of a
    stage: its input and the units above (decoder layers, and on the head stage the MTP depths' layers,
    the head and the MTP depths), less the hidden states nobody keeps (`unkept_hidden_states`)."""
    moe_mtp = a.num_moe_experts > 0
    layers = [layer_memory(a, a.is_moe_layer(i), tokens, precision, local_experts) for i in stage.layers]
    others: list[LayerMemory] = []
    if stage.head:
        layers += [layer_memory(a, moe_mtp, tokens, precision, local_experts)] * a.mtp_num_layers
        others = [head_memory(a, tokens, precision)] + [mtp_memory(a, tokens, precision)] * a.mtp_num_layers
    hidden = _dtype_bytes(precision == "bf16") * a.hidden_size * tokens  # the stage input, or one unkept
    units = [(m.kept, m.peak) for m in layers + others]
    kept = hidden + sum(kept for kept, _ in units) - hidden * unkept_hidden_states(a, stage, precision)
    return kept, max((peak - kept for kept, peak in units), default=0.0)


def build_stages(args: ModelArgs, num_stages: int, layout: str | None = None, first: int | None = None,
                 last: int | None = None) -> list[Stage]:
    """The model cut into `num_stages` chunks as the trainer cuts it (ValueError when it cannot be)."""
    mtp_moe = args.mtp_num_layers if args.num_moe_experts > 0 else 0
    stages = []
    for index, spec in enumerate(stage_specs(args, num_stages, layout, first, last)):
        layers = range(spec.layers[0], spec.layers[-1] + 1) if spec.layers else range(0)
        if tuple(layers) != spec.layers:
            raise ValueError(f"stage {index}: layers {list(spec.layers)} are not contiguous")
        stages.append(Stage(index=index, layers=layers, embedding=spec.embedding, head=spec.loss,
                            moe_layers=sum(args.is_moe_layer(i) for i in layers) + mtp_moe * spec.loss))
    return stages


@dataclass(frozen=True)
class RankParameters:
    """Parameter elements of one pipeline rank, by the replica group that holds them."""

    dense: int  # replicated over dp, the embedding included
    embedding: int  # the embedding's (stage 0's, or the replica the head stage keeps for MTP)
    expert: int  # this EP rank's share of the routed experts, replicated over expert-dp
    tensors: int


def rank_parameters(args: ModelArgs, stages: list[Stage], ep: int) -> RankParameters:
    """The parameters of a pipeline rank holding `stages`, as the trainer's model for those parts
    (built on the meta device) has them."""
    parts = [ModelPart(tuple(s.layers), embedding=s.embedding, head=s.head) for s in stages]
    with torch.device("meta"):
        model = DeepSeekV3(args, parts=parts)
    named = dict(model.named_parameters())
    expert = sum(param.numel() // ep for name, param in named.items() if is_expert_parameter(name))
    dense = sum(param.numel() for name, param in named.items() if not is_expert_parameter(name))
    embedding = named[EMBEDDING].numel() if EMBEDDING in named else 0
    return RankParameters(dense=dense, embedding=embedding, expert=expert, tensors=len(named))
