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

The peak during the layer's backward is the larger of two phases. The FFN's (run first) adds the
incoming output gradient (4d) and the gradients and temporaries alive at once at the widest point of
the FFN's backward: for a SwiGLU of width w, the largest of two gradients of width w, one plus the
down projection's weight gradient (d w b, and with bf16 the bf16 copy of the incoming gradient,
2d), and with bf16 an input projection's weight gradient cast to fp32 (4 d w); for the routed
experts, after the shared expert's activations are freed, the largest of their output gradient (kd),
the down projection's input and weight gradients (kf + E d f) and the gate/up projection's
(E 2 f d, with 3 kf of activations freed). The attention's, once the FFN half is freed: the
attention half's bytes, the layer's output, the incoming gradient and the residual's gradient
(4d each) and the core's gradients of q, k, v and the rope key, b H (3 qk + r).

`recompute_modules` (model/recompute.py), each term measured as the code allocates it:
- `full`: a layer keeps only 4d per token (its input) until its backward, which first rebuilds all
  of the above: the peak is the same.
- the selective modules take off what `recompute_savings` lists (each norm's statistics,
  normalised copy and fp32 output; q, k and v; the experts' SiLU, product and scaled product), net
  of the region inputs they keep, and add what their backward rebuilds to the phase that rebuilds
  it: q, k and v (and with layernorm in fp32 the latents) to the attention's, the experts'
  activation (and in fp32 the post-attention norm's output) to the FFN's.

Outside the decoder layers: the stage input, 4d per token; the final norm, LM head and loss
(`head_memory`, also measured): the fp32 log-probabilities 4V and the norm kept, the head's bf16
weight copy, and in backward the gradients of log-probabilities and logits, 8V; each MTP depth
(`mtp_memory`, not measured; the same rules): its embedding and hidden norms, projection input,
final norm and head, besides its decoder layer. Recomputation covers the decoder layers only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from model.args import FULL_RECOMPUTE, ModelArgs
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

    kept: float  # allocated by its forward and held until its backward
    peak: float  # the most alive at once during its forward and backward


def _ffn_input_bytes(d: int, bf16: bool) -> int:
    """What the two input projections of a SwiGLU keep of an fp32 input: two bf16 casts, or the input."""
    return 2 * 2 * d if bf16 else 4 * d


def attention_terms(a: ModelArgs, bf16: bool) -> dict[str, float]:
    """Bytes per token the attention half of a layer keeps without recomputation, by what keeps them."""
    d, heads, r, b = a.hidden_size, a.num_attention_heads, a.qk_pos_emb_head_dim, 2 if bf16 else 4
    low_rank_norm = lambda width: 4 * width + 4 + 2 * b * width  # noqa: E731
    return {"input_norm": 4 + 4 * d, "attention_input": _ffn_input_bytes(d, bf16),
            "q_norm": low_rank_norm(a.q_lora_rank) if a.q_lora_rank is not None else 0,
            "kv_norm": low_rank_norm(a.kv_lora_rank) + (0 if bf16 else 4 * r),
            "qkv": 3 * b * heads * a.qk_full_head_dim,
            "attention_core": b * (heads * a.qk_full_head_dim + heads * a.v_head_dim) + 4 * heads}


def _shared_expert_kept(a: ModelArgs, bf16: bool) -> int:
    fs = a.moe_shared_expert_intermediate_size
    return (4 * fs * (2 if bf16 else 4) + 2 * 2 * a.hidden_size * bf16) if fs else 0


def ffn_terms(a: ModelArgs, moe: bool, bf16: bool) -> dict[str, float]:
    """The same for the rest of the layer: residual, post-attention norm, FFN and the layer output
    (the residual stream is fp32 in both precisions)."""
    d, b = a.hidden_size, 2 if bf16 else 4
    terms = {"residual": 4 * d, "post_norm": 4 + 4 * d}
    if not moe:
        return {**terms, "ffn_input": _ffn_input_bytes(d, bf16), "ffn": 4 * a.ffn_hidden_size * b, "output": 4 * d}
    k, f = a.moe_router_topk, a.moe_ffn_hidden_size
    router = 4 * a.num_moe_experts + 12 * k + 4 * (a.moe_router_score_function == "sigmoid" and k > 1) \
        + 4 * (a.moe_aux_loss_coeff > 0)
    e = _expert_bytes(bf16)
    return {**terms, "router_input": 4 * d, "router": router + 16 * k, "experts": e * 2 * k * d + 4 * k,
            "expert_activation": e * 5 * k * f, "shared_expert": _shared_expert_kept(a, bf16), "output": 4 * d}


def recompute_savings(a: ModelArgs, moe: bool, bf16: bool) -> dict[str, float]:
    """Bytes per token each selective module of `a.recompute_modules` no longer keeps (model/recompute.py),
    net of the region inputs it keeps instead. layernorm: each norm keeps only its input, no
    statistics, normalised copy or fp32 output (bf16 Linears keep their own casts of it; with bf16 the
    latent norms keep their bf16 input instead of its fp32 copy); mla_up_proj: q, k and v; moe_act:
    the SwiGLU's SiLU, product and scaled product (its gate/up input stays). With bf16 the regions keep
    the kv_a output (its latent and rope key, 2 (kl + r)), and the up-projection keeps the fp32 latents
    (q and kv norm outputs) unless the norms are recomputed too."""
    modules, d, b = set(a.recompute_modules), a.hidden_size, 2 if bf16 else 4
    ql, kl, heads = a.q_lora_rank, a.kv_lora_rank, a.num_attention_heads
    saved: dict[str, float] = {}
    if "layernorm" in modules:
        low_rank = (lambda w: 4 * w + 4) if bf16 else (lambda w: 8 * w + 4)  # noqa: E731
        saved["layernorm_attention"] = (4 + 4 * d + (0 if bf16 else 4 * d) + (low_rank(ql) if ql is not None else 0)
                                        + low_rank(kl) + 2 * kl * bf16)
        # the router's fp32 input, or the fp32 Linears' shared input
        saved["layernorm_ffn"] = 4 + 4 * d + (4 * d if moe or not bf16 else 0)
    if "mla_up_proj" in modules:
        latents = 0 if "layernorm" in modules or not bf16 else 4 * (ql if ql is not None else d) + 4 * kl
        saved["mla_up_proj"] = 3 * b * heads * a.qk_full_head_dim - latents
    if bf16 and modules & {"layernorm", "mla_up_proj"}:
        saved["kv_a_output"] = -2 * (kl + a.qk_pos_emb_head_dim)
    if "moe_act" in modules and moe:
        saved["moe_act"] = 3 * _expert_bytes(bf16) * a.moe_router_topk * a.moe_ffn_hidden_size
    return saved


def _cast_weights(a: ModelArgs, moe: bool, local_experts: int) -> tuple[int, int]:
    """Parameters that autocast casts to bf16 at every forward, (attention's, the FFN's): the Linear
    modules' and the routed experts'."""
    d, heads, r = a.hidden_size, a.num_attention_heads, a.qk_pos_emb_head_dim
    qk = heads * a.qk_full_head_dim
    q = d * qk if a.q_lora_rank is None else a.q_lora_rank * (d + qk)
    kv = d * (a.kv_lora_rank + r) + a.kv_lora_rank * heads * (a.qk_head_dim + a.v_head_dim)
    ffn = 3 * d * (a.moe_shared_expert_intermediate_size if moe else a.ffn_hidden_size)
    routed = 3 * d * a.moe_ffn_hidden_size * local_experts if moe else 0
    return q + kv + heads * a.v_head_dim * d, ffn + routed


def _swiglu_backward(d: int, width: int, tokens: int, bf16: bool) -> float:
    b = 2 if bf16 else 4
    weight_grads = 4 * d * width if bf16 else 0  # an input projection's weight gradient cast to fp32
    return max(2 * width * b * tokens, (width * b + 2 * d * bf16) * tokens + d * width * b, weight_grads)


def _ffn_backward(a: ModelArgs, moe: bool, tokens: int, bf16: bool, experts: int) -> float:
    """Gradients and temporaries alive at once at the widest point of the FFN's backward (run first)."""
    d = a.hidden_size
    if not moe:
        return _swiglu_backward(d, a.ffn_hidden_size, tokens, bf16)
    modules = set(a.recompute_modules)
    k, f, fs = a.moe_router_topk, a.moe_ffn_hidden_size, a.moe_shared_expert_intermediate_size
    shared = _swiglu_backward(d, fs, tokens, bf16) if fs else 0.0
    # the shared expert's backward runs first and frees its activations (and weight copies); its
    # input gradient (fp32, 4d) stays for the routed experts' to be added
    freed = (_shared_expert_kept(a, bf16) - 4 * d) * tokens + 2 * 3 * d * fs * bf16
    e = _expert_bytes(bf16)
    activations = k * f * e * tokens
    # moe_act: the rebuilt down-projection input is alive in its backward; in fp32 the gate/up
    # projection's backward then frees none of the 3 kf (measured; in bf16 that branch is not the peak)
    rebuilt = activations if "moe_act" in modules else 0
    unfreed = 3 * activations if "moe_act" in modules and not bf16 else 0
    routed = max(k * d * e * tokens, activations + experts * d * f * e + rebuilt,
                 -3 * activations + unfreed + experts * 2 * f * d * e) - freed
    # layernorm: in fp32 the shared expert's backward rebuilds the post-attention norm's output,
    # which stays until the router's backward reads it
    rebuilt_norm = 4 * d * tokens if "layernorm" in modules and fs and not bf16 else 0
    return max(shared, routed) + rebuilt_norm


def _attention_backward(a: ModelArgs, tokens: int, bf16: bool) -> float:
    """The attention core's backward: the gradients of q, k, v and of the rope keys (fp32 bytes; in
    bf16 a bound, the FFN's backward is the peak there), plus q, k and v rebuilt under mla_up_proj
    (with layernorm, also the latents they come from, fp32)."""
    modules, heads, qk = set(a.recompute_modules), a.num_attention_heads, a.qk_full_head_dim
    b = 2 if bf16 else 4
    work = b * heads * (3 * qk + a.qk_pos_emb_head_dim)
    if "mla_up_proj" in modules:
        work += 3 * b * heads * qk
        if "layernorm" in modules and not bf16:
            work += 4 * ((a.q_lora_rank or a.hidden_size) + a.kv_lora_rank)
    return work * tokens


def layer_memory(a: ModelArgs, moe: bool, tokens: int, precision: str, local_experts: int | None = None) -> LayerMemory:
    """Bytes of one decoder layer for one micro-batch of `tokens` (see the module docstring), with the
    layer's `a.recompute_modules`; `local_experts`: routed experts on this rank (default all).

    The peak is the larger of two phases of the backward: the FFN's (first), with every attention
    tensor still kept, and the attention's, after the FFN half is freed, with the layer's output,
    the incoming gradient and the gradient of the residual (4d each) alive."""
    bf16, d = precision == "bf16", a.hidden_size
    experts = a.num_moe_experts if local_experts is None else local_experts
    attention_weights, ffn_weights = (2 * n * bf16 for n in _cast_weights(a, moe, experts))
    if FULL_RECOMPUTE in a.recompute_modules:  # keeps its input; the backward rebuilds all of it first
        stored = layer_memory(dataclasses.replace(a, recompute_modules=[]), moe, tokens, precision, local_experts)
        return LayerMemory(4 * d * tokens, stored.peak)
    attention = sum(attention_terms(a, bf16).values())
    savings = recompute_savings(a, moe, bf16)
    ffn_saved = savings.get("layernorm_ffn", 0) + savings.get("moe_act", 0)
    attention_kept = (attention - sum(savings.values()) + ffn_saved) * tokens + attention_weights
    kept = attention_kept + (sum(ffn_terms(a, moe, bf16).values()) - ffn_saved) * tokens + ffn_weights
    output_grad = 4 * d * tokens  # the gradient the layer above hands down, alive through the backward
    ffn_phase = kept + output_grad + _ffn_backward(a, moe, tokens, bf16, experts)
    attention_phase = attention_kept + 3 * 4 * d * tokens + _attention_backward(a, tokens, bf16)
    return LayerMemory(kept, max(ffn_phase, attention_phase))


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
