"""What each pipeline stage holds: layers, parameters (dense / routed experts) and activations.

Stage split: the trainer's (parallel.pipeline.stage.stage_specs: `parallel.pipeline_layout`, or
`first_stage_layers` / `last_stage_layers` and the rest evenly); the embedding sits on stage 0, the
final norm, head and MTP on the last stage. A rank's parameters come from the trainer's model of
its stages built on the meta device (no memory), so they are independent of model/flops.py's
closed forms.

Activation memory of one decoder layer for one micro-batch of T tokens (`layer_memory`), in bytes,
as our model code allocates it (checked against the storages a real layer allocates on CPU, fp32,
with bf16 parameters and with FP8 GEMMs, in tests/unit/test_plan.py). Per token, with d hidden, H
heads, q/kv LoRA ranks ql/kl, rope dim r, qk = nope + r, vd = v head dim and b the bytes of the
parameters' dtype (4 fp32, 2 with train.precision=bf16 or fp8: parallel.mixed_precision's bf16
parameters, so the residual stream, every GEMM's output and what a Linear saves of its input are
bf16; fp8's FP8 copies below). An RMSNorm of width w keeps
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
  b (kd + 5kf + k): their gate/up input, its output, the SiLU, product and scaled product, and the
  slot weights (their outputs are summed by token without being kept: model.moe.SumByToken); shared
  expert 4 fs b (its gate and up outputs packed, the SiLU and the product); with bf16 parameters the
  router's fp32 copy of its gate weight, 4 E d per micro-batch (no other weight is copied);
- layer output b d.
With EP > 1 the dispatch adds its receive buffers and saved ids, which are not counted.

The peak during the layer's backward is the larger of two phases. The FFN's (run first) adds the
incoming output gradient (b d) and the gradients and temporaries alive at once at the widest point
of the FFN's backward: for a SwiGLU of width w, the larger of two gradients of width w and one plus
the down projection's weight gradient (d w b); for the routed experts, after the shared expert's
activations are freed, their output gradient (kd, or the one the gate/up projection hands down, as
large) and the larger of the down projection's input and weight gradients (kf + E d f) and the
gate/up projection's (E 2 f d, with 3 kf of activations freed). The attention's, once the FFN half is freed: the attention half's bytes, the layer's
output, the incoming gradient and the residual's gradient (b d each) and the core's gradients,
b H (3 qk + r).

`recompute_modules` (model/recompute.py), each term measured as the code allocates it:
- `full`: a layer keeps only b d per token (its input) until its backward, which first rebuilds all
  of the above: the peak is the same.
- the selective modules take off what `recompute_savings` lists (each norm's statistics,
  normalised input, output and fp32 copy, and the router's fp32 copy of the post-attention norm's
  output; q, k and v, and the core's output, which SDPA then keeps as o_proj's input, without v's
  padding; the routed experts' SiLU, product and scaled product and the shared expert's SiLU and
  product), net of the region inputs they keep, and add what their backward rebuilds to the phase
  that rebuilds it: q, k, v and the padded output (and with layernorm the latents) to the
  attention's, the experts' activation and the post-attention norm's output to the FFN's (where
  with bf16 parameters that output stays from the shared expert's backward to the router's).

With train.precision=fp8 (bf16 parameters and model.fp8's GEMMs, as the trainer builds them for
pp 1, measured the same way inside the step's `weights_fixed`), `Fp8Gemms` holds what differs:
- every Linear and expert GEMM but the output head's keeps an FP8 copy of its input instead of the
  bf16 input: E4M3 in 128x1 tiles, 1 byte per element and an fp32 scale per 128 tokens and channel;
  a grouped GEMM's rows padded per expert to whole 128-row tiles, at the static bound of
  slots + 127 x local experts, with each tile's expert. Each Linear quantizes its own copy, so the
  attention input (q_a and kv_a) and the FFN's and shared expert's input (gate and up) are kept
  twice, 1 + 1/32 bytes each, where bf16 keeps one tensor of 2;
- the routed and the shared experts keep their SwiGLU's input (the gate/up output) in FP8, 1x128
  tiles, and nothing of the SwiGLU or of the down projection's input (§3.3.3: the down projection's
  backward recomputes them from the cache), with or without moe_act (the shared expert's backward,
  never the peak at these proportions, is modelled as a dense FP8 SwiGLU's);
- under layernorm the copies of the norms' outputs are rebuilt in backward from the norms' replay
  (model.recompute.Recompute.derived) instead of kept: each reader's backward holds its rebuilt copy
  (the routed experts' and the shared expert's only while they run; kv_b's at its weight gradient,
  with mla_up_proj beside the q latent that the core's rebuild of q replayed); mla_up_proj without
  layernorm keeps the two latents it rebuilds q, k and v from, b (ql + kl); under mla_up_proj
  o_proj's copy of the core's output is rebuilt from the bf16 output the core keeps (at o_proj's
  weight gradient);
- the peak of the FFN's backward is a down projection's weight gradient, with its input gradient
  alive: the larger of its output gradient's 128x1 re-quantization (the quantizer's fp32 copy
  padded to whole tiles and its scaled values, 8 bytes per element of a chunk of at most
  model.fp8.QUANTIZE_CHUNK, and the result; for the routed experts also the zero-padded bf16 rows,
  2 bytes per element) and its emulated weight-gradient GEMM (the
  fp32 gradient per expert, one 128-wide chunk's fp32 product and the chunk's dequantized operands);
  for the routed experts with the SwiGLU rebuilt from the cache and its 128x1 re-quantization, and
  also the gate/up projection's, once the down projection's backward has freed the cache. The attention's phase takes the largest of the core's backward, o_proj's weight
  gradient and kv_b's (after the core's, with the gradients of q, the rope key and kv alive). At
  DeepSeek-V3's proportions the peak is a down projection's (the routed experts' in a MoE layer);
  the other moments are checked on shapes where they are the peak.
What is left out, and why: the forward and input-gradient GEMMs of the Linears are torch's blockwise
kernel on a GPU (model.fp8.fp8_mm), which writes bf16, so the CPU emulation's fp32 partials there
are not modelled (the measured peaks show they are never the peak at these proportions); the weight
gradients (fp32 output, which the kernel does not give) and the grouped GEMMs run the emulation on
every device, and the quantizer is the same torch code everywhere, so those are modelled. Not
modelled either: the 1x128 quantization of the gradients for the input-gradient GEMMs, and the
backward of q_a, q_b, kv_a and the dense gate/up projections, smaller than the modelled moments
while a micro-batch has fewer tokens than the hidden size; in the routed down projection's
backward, the cache's dequantization (12 bytes per element of 2kf, before the rebuilt activation
exists) and the SwiGLU's backward (at most 4 more of kf), below its weight gradient's
re-quantization whenever d >= f. The FP8 copies of the weights, one per
step for all micro-batches, are not activations: plan.py counts them with the weights
(`fp8_weight_copy_bytes`).

Outside the decoder layers: the stage input, b d per token; the final norm, LM head and loss
(`head_memory`, also measured): the fp32 log-probabilities 4V and the norm kept, and in backward the
gradients of log-probabilities and logits, 8V; each MTP depth (`mtp_memory`): its embedding and
hidden norms, projection input and output, final norm and head, besides its decoder layer.
Recomputation covers the decoder layers only. A stage (`stage_activation_bytes`) sums these and,
with bf16 parameters, leaves out the hidden states that only norms read (`unkept_hidden_states`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from model.args import FULL_RECOMPUTE, ModelArgs
from model.fp8 import TILE, Fp8GemmOps, quantize_chunk_rows
from model.layers import GemmOps, GroupedLinear, Linear
from model.transformer import DeepSeekV3, ModelPart
from parallel.data_parallel import is_expert_parameter
from parallel.mixed_precision import PARAM_DTYPES
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


def bf16_parameters(precision: str) -> bool:
    """Whether `train.precision` keeps bf16 parameters: bf16, and fp8, whose FP8 GEMMs take bf16 weights."""
    return PARAM_DTYPES[precision] == torch.bfloat16


def _dtype_bytes(bf16: bool) -> int:
    """b: bytes per element of the parameters' dtype, which the activations take too."""
    return 2 if bf16 else 4


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Fp8Gemms:
    """What train.precision=fp8's GEMMs (model.fp8) allocate for one micro-batch of `tokens`, whose
    `slots` routed rows (top-k x tokens: balanced routing gives each EP rank as many) go to `groups`
    local experts. Saved inputs are in bytes per token, like the other terms; backward moments in bytes."""

    tokens: int
    slots: int
    groups: int

    @property
    def token_tiles(self) -> int:
        """128-token tiles of a Linear's 128x1 operands: one fp32 scale per tile and channel."""
        return _ceil_div(self.tokens, TILE)

    @property
    def padded_slots(self) -> int:
        """The routed rows, each expert's padded to whole 128-row tiles, at the static bound
        model.fp8.group_tiles allocates (rows + 127 experts, in whole tiles)."""
        return TILE * ((self.slots + (TILE - 1) * self.groups) // TILE)

    def saved_input(self, width: int) -> float:
        """Per token, what an FP8 Linear saves of an input of `width` for its weight gradient: E4M3 in
        128x1 tiles, 1 byte per element and an fp32 scale per 128 tokens of each channel."""
        return width * (1 + 4 * self.token_tiles / self.tokens)

    def saved_routed_input(self, width: int) -> float:
        """Per token, what a grouped FP8 GEMM saves of its routed input of `width`: the E4M3 of the
        group-padded rows, an fp32 scale per 128-row tile and channel, and each tile's expert (int64)."""
        tiles = self.padded_slots // TILE
        return (self.padded_slots * width + 4 * width * tiles + 8 * tiles) / self.tokens

    def swiglu_cache(self, width: int, rows: int | None = None) -> float:
        """Per token, a MoE SwiGLU's input (its gate/up output, `width` = 2f per row) cached in FP8
        (model.fp8.Fp8ActivatedFunction): E4M3 in 1x128 tiles, 1 byte per element and an fp32 scale
        per row and 128 channels; `rows`: the routed experts' slots (default), or the shared expert's
        tokens."""
        rows = self.slots if rows is None else rows
        return rows * (width + 4 * _ceil_div(width, TILE)) / self.tokens

    def requantization(self, width: int) -> float:
        """Bytes alive while a Linear's output gradient of `width` is quantized into 128x1 tiles for its
        weight gradient (model.fp8.quantize_128x1): the quantizer's temporaries and its result."""
        return quantizer_temporaries(width, self.tokens) + self.saved_input(width) * self.tokens

    def routed_requantization(self, width: int) -> float:
        """Bytes alive while a routed gradient of `width` is re-quantized into 128x1 tiles for the weight
        gradient (model.fp8.quantize_128x1_grouped): the zero-padded bf16 rows (2 bytes per padded element)
        and the quantizer's temporaries, besides its result (as `saved_routed_input`) and each row's
        padded position (int64)."""
        return 2 * self.padded_slots * width + quantizer_temporaries(width, self.padded_slots) \
            + self.saved_routed_input(width) * self.tokens + 8 * self.slots


def quantizer_temporaries(rows: int, cols: int) -> int:
    """Bytes model.fp8's quantizer allocates besides its result while it converts x [rows, cols] into
    1x128 tiles (the 128x1 tiling of a [cols, rows] tensor): one chunk of `quantize_chunk_rows` rows'
    fp32 copy padded to whole tiles and scaled values (8 bytes per element) and its tile scales."""
    chunk, tiles = min(rows, quantize_chunk_rows((rows, cols), 1)), _ceil_div(cols, TILE)
    return 8 * chunk * tiles * TILE + 4 * chunk * tiles


def _emulated_weight_grad(out_width: int, in_width: int, groups: int, rows: int) -> int:
    """model.fp8's emulated weight-gradient GEMM over `rows` tokens (or padded routed rows), which every
    device runs (it returns fp32, which torch's blockwise kernel does not): the fp32 gradient of each
    group's [out, in] weight, one chunk's fp32 product and the chunk's dequantized operands
    [out + in, up to 128 rows] with their rows' scales (one per 128-row tile)."""
    chunk, tiles = min(TILE, rows), _ceil_div(rows, TILE)
    return 4 * (groups + 1) * out_width * in_width + 4 * (chunk + tiles) * (out_width + in_width)


def _fp8_linear_backward(out_width: int, in_width: int, b: int, fp8: Fp8Gemms) -> float:
    """The widest point of an FP8 Linear's backward, its weight gradient: with its input gradient alive
    (b x in, from the input-gradient GEMM before it), the larger of the output gradient's 128x1
    re-quantization and the emulated GEMM (the re-quantized gradient alive)."""
    gemm = fp8.saved_input(out_width) * fp8.tokens + _emulated_weight_grad(out_width, in_width, 1, fp8.tokens)
    return b * in_width * fp8.tokens + max(fp8.requantization(out_width), gemm)


def _linear_inputs(width: int, readers: int, b: int, fp8: Fp8Gemms | None) -> float:
    """Per token, what the `readers` Linears of one input of `width` keep of it: the input itself
    (b w, one tensor for all), or with FP8 GEMMs an FP8 copy each."""
    return readers * fp8.saved_input(width) if fp8 else b * width


def _routed_inputs(width: int, topk: int, b: int, fp8: Fp8Gemms | None) -> float:
    """Per token, what a routed experts' GEMM keeps of its input of `width` per slot: the rows
    themselves (b k w), or with FP8 GEMMs their group-padded FP8 copy."""
    return fp8.saved_routed_input(width) if fp8 else b * topk * width


def _norm_bytes(width: int, bf16: bool) -> int:
    """What an RMSNorm of `width` keeps besides its input and output: its statistics (4) and its
    normalised input (b w), and with bf16 parameters the fp32 copy of its bf16 input (4w) that it
    normalises (in fp32 that is the input itself)."""
    return 4 + _dtype_bytes(bf16) * width + 4 * width * bf16


def attention_terms(a: ModelArgs, bf16: bool, fp8: Fp8Gemms | None = None) -> dict[str, float]:
    """Bytes per token the attention half of a layer keeps without recomputation, by what keeps them."""
    d, heads, r, b = a.hidden_size, a.num_attention_heads, a.qk_pos_emb_head_dim, _dtype_bytes(bf16)

    def low_rank_norm(width: int) -> float:  # a LoRA norm and what its up-projection keeps of its output
        return _norm_bytes(width, bf16) + _linear_inputs(width, 1, b, fp8) + 4 * width * (not bf16)

    return {"input_norm": _norm_bytes(d, bf16), "attention_input": _linear_inputs(d, 2, b, fp8),
            "q_norm": low_rank_norm(a.q_lora_rank) if a.q_lora_rank is not None else 0,
            "kv_norm": low_rank_norm(a.kv_lora_rank) + (0 if bf16 else 4 * r),
            "qkv": 3 * b * heads * a.qk_full_head_dim,
            "attention_core": b * heads * a.qk_full_head_dim + _linear_inputs(heads * a.v_head_dim, 1, b, fp8)
            + 4 * heads}


def _swiglu_kept(width: int, b: int, fp8: Fp8Gemms | None) -> float:
    """Per token, a SwiGLU's activations of `width`: the gate and up outputs, the SiLU, and the product
    (the down projection's input, an FP8 copy with FP8 GEMMs)."""
    return 3 * width * b + _linear_inputs(width, 1, b, fp8)


def _shared_expert_kept(a: ModelArgs, bf16: bool, fp8: Fp8Gemms | None = None) -> float:
    """Its activations of width fs (with FP8 GEMMs its SwiGLU's input cached in FP8, as the routed
    experts'); with bf16 parameters also its input, the post-attention norm's bf16 output (in fp32 that
    tensor is the router's input, counted there), or with FP8 GEMMs the gate and up projections'
    copies of it."""
    fs, b = a.moe_shared_expert_intermediate_size, _dtype_bytes(bf16)
    if not fs:
        return 0
    activations = fp8.swiglu_cache(2 * fs, fp8.tokens) if fp8 else _swiglu_kept(fs, b, fp8)
    return activations + _linear_inputs(a.hidden_size, 2, b, fp8) * bf16


def ffn_terms(a: ModelArgs, moe: bool, bf16: bool, fp8: Fp8Gemms | None = None) -> dict[str, float]:
    """The same for the rest of the layer: residual, post-attention norm, FFN and the layer output
    (the residual is kept by the post-attention norm: in fp32 itself, with bf16 parameters its fp32
    copy, 4d in both)."""
    d, b = a.hidden_size, _dtype_bytes(bf16)
    terms = {"residual": 4 * d, "post_norm": _norm_bytes(d, bf16) - 4 * d * bf16}
    if not moe:
        return {**terms, "ffn_input": _linear_inputs(d, 2, b, fp8), "ffn": _swiglu_kept(a.ffn_hidden_size, b, fp8),
                "output": b * d}
    k, f = a.moe_router_topk, a.moe_ffn_hidden_size
    router = 4 * a.num_moe_experts + 12 * k + 4 * (a.moe_router_score_function == "sigmoid" and k > 1) \
        + 4 * (a.moe_aux_loss_coeff > 0)
    # experts: their slot weights and gate/up input; their activation: the gate/up output, SiLU, product
    # and scaled product (the down projection's input), or with FP8 GEMMs the gate/up output cached in FP8
    activation = fp8.swiglu_cache(2 * f) if fp8 else 5 * b * k * f
    return {**terms, "router_input": 4 * d, "router": router + 16 * k,
            "experts": b * k + _routed_inputs(d, k, b, fp8), "expert_activation": activation,
            "shared_expert": _shared_expert_kept(a, bf16, fp8), "output": b * d}


def recompute_savings(a: ModelArgs, moe: bool, bf16: bool, fp8: Fp8Gemms | None = None) -> dict[str, float]:
    """Bytes per token each selective module of `a.recompute_modules` no longer keeps (model/recompute.py),
    net of the region inputs it keeps instead. layernorm: each norm keeps only its input, none of
    `_norm_bytes` and not its output; with bf16 parameters the q and kv latent norms keep their bf16
    inputs (the q_a and kv_a outputs) and the post-attention norm the bf16 residual instead of their
    fp32 copies, and the router's fp32 copy of the norm's output (4d) is rebuilt too; mla_up_proj: q,
    k and v, and the core's padded output, which it keeps as o_proj's input; moe_act: the routed
    experts' SiLU, product and scaled product and the shared expert's SiLU and product (their gate/up
    outputs stay). With bf16 parameters either of the first two keeps the kv_a output (its latent and
    rope key, 2 (kl + r)); in fp32 the kv norm kept it already.

    With FP8 GEMMs the norms' readers keep FP8 copies of their outputs, which layernorm rebuilds from
    the norms' replay as bf16 rebuilds the outputs; mla_up_proj keeps the core's output in bf16 and
    rebuilds o_proj's FP8 copy of it, and without layernorm keeps the two latents it rebuilds q, k
    and v from (b (ql + kl)), which the FP8 up-projections did not keep; moe_act saves nothing: the
    FP8 experts, routed and shared, always keep only their SwiGLU's input, in FP8, and recompute the
    rest."""
    modules, d, b = set(a.recompute_modules), a.hidden_size, _dtype_bytes(bf16)
    ql, kl, heads = a.q_lora_rank, a.kv_lora_rank, a.num_attention_heads
    def norm_output(width: int, readers: int) -> float:
        """What a norm's `readers` Linears keep of its output: the output, or their FP8 copies."""
        return _linear_inputs(width, readers, b, fp8)

    saved: dict[str, float] = {}
    if "layernorm" in modules:
        low_rank = lambda w: _norm_bytes(w, bf16) + norm_output(w, 1)  # noqa: E731
        q_norm = low_rank(ql) - 2 * ql * bf16 if ql is not None else 0
        saved["layernorm_attention"] = _norm_bytes(d, bf16) + norm_output(d, 2) + q_norm + low_rank(kl)
        # the norm's output: the FFN's input, or in a MoE layer the router's fp32 input (fp32) or the
        # shared expert's input (bf16)
        output = norm_output(d, 2) * (not (moe and bf16) or a.moe_shared_expert_intermediate_size > 0)
        # with bf16 parameters the router's fp32 copy of the norm's output is rebuilt from its replay
        router_copy = 4 * d * (moe and bf16)
        saved["layernorm_ffn"] = _norm_bytes(d, bf16) + output - 2 * d * bf16 + router_copy
    if "mla_up_proj" in modules:
        # q, k and v; and the core's output, kept as o_proj's input (with FP8 GEMMs kept in bf16 and
        # o_proj's FP8 copy of it rebuilt from that in backward)
        output = b * heads * a.qk_full_head_dim
        if fp8:
            output += _linear_inputs(heads * a.v_head_dim, 1, b, fp8) - b * heads * a.v_head_dim
        saved["mla_up_proj"] = 3 * b * heads * a.qk_full_head_dim + output
        if fp8 and "layernorm" not in modules:
            saved["up_projection_inputs"] = -b * ((ql or d) + kl)
    if bf16 and modules & {"layernorm", "mla_up_proj"}:
        saved["kv_a_output"] = -2 * (kl + a.qk_pos_emb_head_dim)
    if "moe_act" in modules and moe:
        # the routed experts' SiLU, product and scaled product, and the shared expert's SiLU and product
        # (the FP8 experts keep only their FP8 cache either way)
        routed = 0 if fp8 else 3 * b * a.moe_router_topk * a.moe_ffn_hidden_size
        saved["moe_act"] = routed + _shared_activation_saving(a, b, fp8)
    return saved


def _shared_activation_saving(a: ModelArgs, b: int, fp8: Fp8Gemms | None) -> float:
    """Per token, what `moe_act` takes off the shared expert's activations: its SiLU and product (the
    down projection's input), rebuilt from the gate and up outputs it keeps. With FP8 GEMMs nothing:
    it always keeps only their FP8 cache."""
    fs = a.moe_shared_expert_intermediate_size
    return 2 * b * fs if "moe_act" in a.recompute_modules and fs and not fp8 else 0


def _swiglu_backward(d: int, width: int, tokens: int, bf16: bool, fp8: Fp8Gemms | None = None) -> float:
    """With FP8 GEMMs, the down projection's weight gradient (`_fp8_linear_backward`)."""
    b = _dtype_bytes(bf16)
    if fp8:
        return _fp8_linear_backward(d, width, b, fp8)
    return max(2 * width * b * tokens, width * b * tokens + d * width * b)


def _routed_weight_grad(out_width: int, in_width: int, fp8: Fp8Gemms) -> float:
    """The weight gradient of a grouped FP8 GEMM: the larger of its output gradient's 128x1
    re-quantization and its emulated GEMM (the re-quantized gradient alive)."""
    gemm = fp8.saved_routed_input(out_width) * fp8.tokens \
        + _emulated_weight_grad(out_width, in_width, fp8.groups, fp8.padded_slots)
    return max(fp8.routed_requantization(out_width), gemm)


def _fp8_routed_backward(a: ModelArgs, bf16: bool, fp8: Fp8Gemms) -> float:
    """The routed experts' backward with FP8 GEMMs at the weight gradient of the down projection or,
    once its backward has freed the FP8 cache, of the gate/up projection (its output gradient, b 2kf,
    alive), each with the gradient of the routed outputs (b k d) or the one the gate/up projection
    hands down (as large) alive. The down projection's backward rebuilds the SwiGLU from the cache: the
    dequantized gate/up rows (b 2kf), the SiLU, the product and the scaled product (b kf each), then
    its input gradient (b kf); its weight gradient then re-quantizes the rebuilt activation into
    128x1 tiles, then the output gradient (or runs the GEMM), the activation's tiles alive."""
    d, f, tokens = a.hidden_size, a.moe_ffn_hidden_size, fp8.tokens
    intermediate_grad = 2 * a.moe_router_topk * f * tokens  # b k f
    rebuilt = 5 * intermediate_grad
    down = rebuilt + intermediate_grad + max(
        fp8.routed_requantization(f), fp8.saved_routed_input(f) * tokens + _routed_weight_grad(d, f, fp8))
    cache = ffn_terms(a, True, bf16, fp8)["expert_activation"]
    gate_up = 2 * intermediate_grad - cache * tokens + _routed_weight_grad(2 * f, d, fp8)
    return 2 * a.moe_router_topk * d * tokens + max(down, gate_up)


def _ffn_backward(a: ModelArgs, moe: bool, tokens: int, bf16: bool, experts: int,
                  fp8: Fp8Gemms | None = None) -> float:
    """Gradients and temporaries alive at once at the widest point of the FFN's backward (run first)."""
    d = a.hidden_size
    if not moe:
        return _swiglu_backward(d, a.ffn_hidden_size, tokens, bf16, fp8)
    modules = set(a.recompute_modules)
    k, f, fs = a.moe_router_topk, a.moe_ffn_hidden_size, a.moe_shared_expert_intermediate_size
    shared = _swiglu_backward(d, fs, tokens, bf16, fp8) if fs else 0.0
    # the shared expert's backward runs first and frees what it kept (with FP8 GEMMs under layernorm
    # its gate and up rebuild their input copies and free them); its input gradient (b d) stays for
    # the routed experts' to be added
    b = _dtype_bytes(bf16)
    rebuilt_copies = _linear_inputs(d, 2, b, fp8) if fp8 and fs and "layernorm" in modules else 0
    freed = (_shared_expert_kept(a, bf16, fp8) - _shared_activation_saving(a, b, fp8) - rebuilt_copies - b * d) \
        * tokens
    # layernorm with bf16 parameters: the norm's output that the shared expert's backward rebuilt stays
    # through the routed experts' backward, until the router's rebuilds its fp32 copy from it
    waiting = b * d * tokens if bf16 and fs and "layernorm" in modules else 0
    if fp8:
        return max(shared, _fp8_routed_backward(a, bf16, fp8) - freed + waiting)
    activations = k * f * b * tokens
    # moe_act: the rebuilt down-projection input is alive in its backward; the gate/up projection's
    # backward then frees none of the 3 kf (they were not kept)
    rebuilt = activations if "moe_act" in modules else 0
    unfreed = 3 * activations if "moe_act" in modules else 0
    # the gradient of the routed outputs, then the one the gate/up projection hands down (as large)
    routed_grad = k * d * b * tokens
    routed = routed_grad + max(0, activations + experts * d * f * b + rebuilt,
                               -3 * activations + unfreed + experts * 2 * f * d * b) - freed + waiting
    # layernorm: the shared expert's backward rebuilds the post-attention norm's output. In fp32 that
    # output, the router's input, stays until the router's backward reads it (4d). With bf16 parameters
    # `freed` took off the shared expert's input (2d), which the region rebuilt rather than kept: it is
    # added back here (`waiting` holds the rebuilt output itself)
    rebuilt_norm = b * d * tokens if "layernorm" in modules and fs else 0
    return max(shared, routed) + rebuilt_norm


def _attention_backward(a: ModelArgs, tokens: int, bf16: bool, fp8: Fp8Gemms | None = None) -> float:
    """The attention core's backward: the gradients of q, k, v and of the rope keys, plus q, k and v
    rebuilt under mla_up_proj (with layernorm, also the latents they come from). With FP8 GEMMs the
    largest of that, o_proj's weight gradient before it and kv_b's after it."""
    modules, heads, qk = set(a.recompute_modules), a.num_attention_heads, a.qk_full_head_dim
    b = _dtype_bytes(bf16)
    work = b * heads * (3 * qk + a.qk_pos_emb_head_dim)
    if "mla_up_proj" in modules:
        # q, k and v rebuilt, and the core's output padded again from o_proj's input, which stays for it
        # (with FP8 GEMMs it is among the kept bytes, beside o_proj's copy)
        work += 3 * b * heads * qk + b * heads * qk + (0 if fp8 else b * heads * a.v_head_dim)
        if "layernorm" in modules:
            work += b * ((a.q_lora_rank or a.hidden_size) + a.kv_lora_rank)
    if not fp8:
        return work * tokens
    o_proj = _fp8_linear_backward(a.hidden_size, heads * a.v_head_dim, b, fp8)
    o_proj_copy = _linear_inputs(heads * a.v_head_dim, 1, b, fp8)
    if "mla_up_proj" in modules:  # o_proj rebuilds its FP8 copy of the core's output for its backward
        o_proj += o_proj_copy * tokens
    # kv_b's backward runs once the core's saved tensors and o_proj's input are freed, with the
    # gradients of q, of the rope key and of its own output alive; under layernorm also the FP8 copy of
    # its input that it rebuilt from the kv norm's replay, and with mla_up_proj the q latent that the
    # core's rebuild of q replayed, alive until q_b's backward rebuilds its copy from it
    terms, kv_width = attention_terms(a, bf16, fp8), heads * (a.qk_head_dim + a.v_head_dim)
    core_saved = terms["attention_core"] + terms["qkv"] * ("mla_up_proj" not in modules)
    if "mla_up_proj" in modules:  # the core kept its output as o_proj's bf16 input, without v's padding
        core_saved -= b * heads * (qk - a.v_head_dim) + o_proj_copy
    rebuilt = 0
    if "layernorm" in modules:
        rebuilt = _linear_inputs(a.kv_lora_rank, 1, b, fp8) + b * (a.q_lora_rank or a.hidden_size) * (
            "mla_up_proj" in modules)
    gradients = b * (heads * qk + a.qk_pos_emb_head_dim + kv_width) + rebuilt
    kv_b = (gradients - core_saved) * tokens + _fp8_linear_backward(kv_width, a.kv_lora_rank, b, fp8)
    return max(work * tokens, o_proj, kv_b)


def _router_weight(a: ModelArgs, moe: bool, bf16: bool) -> int:
    """The router's fp32 copy of its bf16 gate weight, E d, which its logits' GEMM keeps per micro-batch."""
    return 4 * a.num_moe_experts * a.hidden_size * (moe and bf16)


def layer_memory(a: ModelArgs, moe: bool, tokens: int, precision: str, local_experts: int | None = None) -> LayerMemory:
    """Bytes of one decoder layer for one micro-batch of `tokens` (see the module docstring), with the
    layer's `a.recompute_modules`; `local_experts`: routed experts on this rank (default all).

    The peak is the larger of two phases of the backward: the FFN's (first), with every attention
    tensor still kept, and the attention's, after the FFN half is freed, with the layer's output,
    the incoming gradient and the gradient of the residual (b d each) alive."""
    bf16, d = bf16_parameters(precision), a.hidden_size
    experts = a.num_moe_experts if local_experts is None else local_experts
    fp8 = _fp8_gemms(a, tokens, precision, experts)
    hidden = _dtype_bytes(bf16) * d * tokens  # one hidden state: the layer's output, or a gradient of it
    if FULL_RECOMPUTE in a.recompute_modules:  # keeps its input; the backward rebuilds all of it first
        stored = layer_memory(dataclasses.replace(a, recompute_modules=[]), moe, tokens, precision, local_experts)
        return LayerMemory(hidden, stored.peak)
    attention = sum(attention_terms(a, bf16, fp8).values())
    savings = recompute_savings(a, moe, bf16, fp8)
    ffn_saved = savings.get("layernorm_ffn", 0) + savings.get("moe_act", 0)
    attention_kept = (attention - sum(savings.values()) + ffn_saved) * tokens
    kept = attention_kept + (sum(ffn_terms(a, moe, bf16, fp8).values()) - ffn_saved) * tokens \
        + _router_weight(a, moe, bf16)
    output_grad = hidden  # the gradient the layer above hands down, alive through the backward
    ffn_phase = kept + output_grad + _ffn_backward(a, moe, tokens, bf16, experts, fp8)
    attention_phase = attention_kept + 3 * hidden + _attention_backward(a, tokens, bf16, fp8)
    return LayerMemory(kept, max(ffn_phase, attention_phase))


def _fp8_gemms(a: ModelArgs, tokens: int, precision: str, local_experts: int | None = None) -> Fp8Gemms | None:
    """The FP8 GEMMs' allocations for a micro-batch under train.precision=fp8 (None otherwise)."""
    if precision != "fp8":
        return None
    experts = a.num_moe_experts if local_experts is None else local_experts
    return Fp8Gemms(tokens, a.moe_router_topk * tokens, experts)


def head_memory(a: ModelArgs, tokens: int, precision: str) -> LayerMemory:
    """Final norm, LM head and cross-entropy for one micro-batch: the fp32 log-probabilities (4V per
    token) and the norm with its output (the head's input) are kept; backward adds the gradients of
    the log-probabilities and logits."""
    bf16, d, vocab = bf16_parameters(precision), a.hidden_size, a.vocab_size
    norm = _norm_bytes(d, bf16) + _dtype_bytes(bf16) * d
    kept = (4 * vocab + norm) * tokens
    return LayerMemory(kept, kept + 8 * vocab * tokens)


def mtp_memory(a: ModelArgs, tokens: int, precision: str) -> LayerMemory:
    """One MTP depth without its decoder layer: the embedding and hidden norms, their concatenated
    outputs (the projection's input; with FP8 GEMMs its FP8 copy), the projection's output (the
    layer's input), the layer output's final norm and the head (bf16 GEMMs in fp8 too). fp32 (not
    measured) also counts the embedding's output (the embedding norm's input, 4d) and 4d for the hidden
    norm's input, which the last decoder layer's output already counts."""
    bf16, d = bf16_parameters(precision), a.hidden_size
    b = _dtype_bytes(bf16)
    norms = 2 * _norm_bytes(d, bf16) + _linear_inputs(2 * d, 1, b, _fp8_gemms(a, tokens, precision)) + b * d \
        + 8 * d * (not bf16)
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
    if not bf16_parameters(precision):
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
    hidden = _dtype_bytes(bf16_parameters(precision)) * a.hidden_size * tokens  # the stage input, or one unkept
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


def _meta_model(args: ModelArgs, stages: list[Stage], gemms: GemmOps | None = None) -> DeepSeekV3:
    """The trainer's model of a pipeline rank holding `stages`, on the meta device (no memory)."""
    parts = [ModelPart(tuple(s.layers), embedding=s.embedding, head=s.head) for s in stages]
    with torch.device("meta"):
        return DeepSeekV3(args, gemms=gemms, parts=parts)


def rank_parameters(args: ModelArgs, stages: list[Stage], ep: int) -> RankParameters:
    """The parameters of a pipeline rank holding `stages`, as the trainer's model for those parts
    (built on the meta device) has them."""
    named = dict(_meta_model(args, stages).named_parameters())
    expert = sum(param.numel() // ep for name, param in named.items() if is_expert_parameter(name))
    dense = sum(param.numel() for name, param in named.items() if not is_expert_parameter(name))
    embedding = named[EMBEDDING].numel() if EMBEDDING in named else 0
    return RankParameters(dense=dense, embedding=embedding, expert=expert, tensors=len(named))


def _fp8_weight_copy(groups: int, rows: int, columns: int) -> int:
    """Bytes of model.fp8.quantize_128x128 of `groups` weights [rows, columns]: 1 byte per element and
    an fp32 scale per 128x128 block."""
    return groups * (rows * columns + 4 * _ceil_div(rows, TILE) * _ceil_div(columns, TILE))


def fp8_weight_copy_bytes(args: ModelArgs, stages: list[Stage], ep: int) -> int:
    """Bytes of the FP8 copies train.precision=fp8 makes of a pipeline rank's weights: one per weight an
    FP8 GEMM takes (every Linear and expert GEMM but the output head's), made by the step's first
    forward and shared by its micro-batches until the step ends (model.fp8.Fp8GemmOps.weights_fixed);
    of the routed experts, this EP rank's."""
    total = 0
    for name, module in _meta_model(args, stages, Fp8GemmOps()).named_modules():
        if isinstance(module, (Linear, GroupedLinear)) and isinstance(module.gemms, Fp8GemmOps):
            *groups, rows, columns = module.weight.shape
            local = math.prod(groups) // (ep if is_expert_parameter(f"{name}.weight") else 1)
            total += _fp8_weight_copy(local, rows, columns)
    return total
