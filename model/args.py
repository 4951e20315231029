"""`ModelArgs`: the hyper-parameters of a DeepSeek-V3-family model, with Megatron's field names.

The same dataclass is the `model:` section of the YAML config, so a Megatron user recognises every
key. `validate()` lists every impossible setting (key, message) instead of failing on the first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from model.intervals import COUNT, NON_NEGATIVE, POSITIVE, POSITIVE_COUNT, Interval, interval_problems

ROPE_TYPES = ("rope", "yarn")
SCORE_FUNCTIONS = ("sigmoid", "softmax")
FULL_RECOMPUTE = "full"
SELECTIVE_RECOMPUTE = ("layernorm", "mla_up_proj", "moe_act")  # what each rebuilds: model/recompute.py

# Every numeric key's allowed values (the router's group counts are checked with the expert count).
INTERVALS: dict[str, Interval] = {
    **dict.fromkeys(("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_lora_rank",
                     "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "num_moe_experts", "moe_ffn_hidden_size",
                     "moe_router_topk", "vocab_size", "max_position_embeddings", "original_max_position_embeddings"),
                    POSITIVE_COUNT),
    "q_lora_rank": Interval(low=1, optional=True),  # null: a direct q projection
    **dict.fromkeys(("moe_shared_expert_intermediate_size", "first_k_dense_replace", "mtp_num_layers"), COUNT),
    **dict.fromkeys(("moe_router_topk_scaling_factor", "rotary_scaling_factor", "beta_fast", "beta_slow",
                     "init_method_std"), POSITIVE),
    **dict.fromkeys(("moe_router_bias_update_rate", "moe_aux_loss_coeff", "mtp_loss_scaling_factor", "mscale",
                     "mscale_all_dim"), NON_NEGATIVE),
    "rotary_base": Interval(low=1, low_open=True),  # the wavelengths grow with the channel index
    "norm_epsilon": Interval(low=0, high=1, low_open=True, high_open=True),
}


@dataclass
class ModelArgs:
    """The model section (Megatron's TransformerConfig names).

    Attributes:
        num_layers: decoder layers of the main model
        hidden_size: model width
        ffn_hidden_size: intermediate size of the dense SwiGLU MLPs
        num_attention_heads: MLA attention heads
        q_lora_rank: rank of the low-rank query projection (null: a direct q projection)
        kv_lora_rank: rank of the compressed key-value latent
        qk_head_dim: query/key head dimension without RoPE
        qk_pos_emb_head_dim: query/key head dimension that carries RoPE (even)
        v_head_dim: value head dimension
        num_moe_experts: routed experts per MoE layer
        moe_ffn_hidden_size: intermediate size of each routed expert
        moe_shared_expert_intermediate_size: intermediate size of the shared expert (0: none)
        moe_router_topk: experts each token is routed to
        moe_router_num_groups: expert groups for group-limited routing (1: no group limit)
        moe_router_group_topk: groups each token may route into
        moe_router_topk_scaling_factor: factor on the normalised top-k routing weights
        moe_router_score_function: sigmoid (DeepSeek-V3) or softmax
        moe_router_enable_expert_bias: aux-loss-free load balancing with a per-expert routing bias
        moe_router_bias_update_rate: step size of the expert-bias update
        moe_aux_loss_coeff: weight of the sequence-level auxiliary balance loss
        first_k_dense_replace: leading decoder layers with a dense MLP instead of MoE
        mtp_num_layers: multi-token-prediction modules (0: none)
        mtp_loss_scaling_factor: weight of the MTP loss
        rotary_base: RoPE base frequency
        rope_type: rope or yarn
        rotary_scaling_factor: YaRN context extension factor
        original_max_position_embeddings: YaRN: the context length before extension
        max_position_embeddings: longest sequence the positions support
        beta_fast: YaRN's fast-rotation boundary
        beta_slow: YaRN's slow-rotation boundary
        mscale: YaRN's attention scale factor
        mscale_all_dim: YaRN's attention scale factor over all dimensions
        norm_epsilon: RMSNorm epsilon
        vocab_size: vocabulary size of the embedding and the output head
        init_method_std: standard deviation of the normal weight initialisation
        recompute_modules: what each decoder layer rebuilds in backward instead of storing (model.recompute):
            any of layernorm, mla_up_proj, moe_act (DeepSeek-V3's set is all three), or [full] (the
            whole layer); [] stores everything
    """

    num_layers: int = 4
    hidden_size: int = 64
    ffn_hidden_size: int = 160
    num_attention_heads: int = 4
    q_lora_rank: Optional[int] = 48
    kv_lora_rank: int = 32
    qk_head_dim: int = 16
    qk_pos_emb_head_dim: int = 8
    v_head_dim: int = 16
    num_moe_experts: int = 8
    moe_ffn_hidden_size: int = 32
    moe_shared_expert_intermediate_size: int = 32
    moe_router_topk: int = 2
    moe_router_num_groups: int = 4
    moe_router_group_topk: int = 2
    moe_router_topk_scaling_factor: float = 2.5
    moe_router_score_function: str = "sigmoid"
    moe_router_enable_expert_bias: bool = True
    moe_router_bias_update_rate: float = 1e-3
    moe_aux_loss_coeff: float = 1e-4
    first_k_dense_replace: int = 1
    mtp_num_layers: int = 1
    mtp_loss_scaling_factor: float = 0.3
    rotary_base: float = 10000.0
    rope_type: str = "rope"
    rotary_scaling_factor: float = 40.0
    original_max_position_embeddings: int = 4096
    max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    norm_epsilon: float = 1e-6
    vocab_size: int = 1024
    init_method_std: float = 0.02
    recompute_modules: list[str] = field(default_factory=list)

    @property
    def qk_full_head_dim(self) -> int:
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense_replace

    def is_moe_layer(self, layer_index: int) -> bool:
        return layer_index >= self.first_k_dense_replace

    def validate(self) -> list[tuple[str, str]]:
        """Every problem as (key, message); empty when the shape is buildable."""
        problems = interval_problems(self, INTERVALS)
        if self.qk_pos_emb_head_dim % 2:
            problems.append(("qk_pos_emb_head_dim", "must be even: RoPE rotates pairs of channels"))
        if self.first_k_dense_replace > self.num_layers:
            problems.append(("first_k_dense_replace",
                             f"{self.first_k_dense_replace} dense layers exceed num_layers={self.num_layers}"))
        if self.rope_type not in ROPE_TYPES:
            problems.append(("rope_type", f"must be one of {ROPE_TYPES}, got {self.rope_type!r}"))
        elif self.rope_type == "yarn" and self.rotary_scaling_factor < 1:
            problems.append(("rotary_scaling_factor", "YaRN needs a factor >= 1"))
        elif self.rope_type == "yarn" and not self.beta_fast > self.beta_slow:
            problems.append(("beta_fast", f"YaRN needs beta_fast > beta_slow, got {self.beta_fast} <= {self.beta_slow}"))
        if self.moe_router_score_function not in SCORE_FUNCTIONS:
            problems.append(("moe_router_score_function",
                             f"must be one of {SCORE_FUNCTIONS}, got {self.moe_router_score_function!r}"))
        problems.extend(("recompute_modules", message) for message in recompute_problems(self.recompute_modules))
        problems.extend(self._router_problems())
        return problems

    def _router_problems(self) -> list[tuple[str, str]]:
        experts, groups, keep, topk = (self.num_moe_experts, self.moe_router_num_groups,
                                       self.moe_router_group_topk, self.moe_router_topk)
        if experts <= 0 or topk <= 0:
            return []
        if topk > experts:
            return [("moe_router_topk", f"top-{topk} of only {experts} experts")]
        if groups <= 0:
            return [("moe_router_num_groups", "must be >= 1 (1 means no group limit)")]
        if experts % groups:
            return [("moe_router_num_groups",
                     f"num_moe_experts={experts} is not divisible by {groups} groups")]
        if groups == 1:
            return []
        per_group = experts // groups
        problems = []
        if per_group < 2:
            problems.append(("moe_router_num_groups",
                             f"{per_group} expert per group; the group score sums the top-2 experts of a group"))
        if not 1 <= keep <= groups:
            problems.append(("moe_router_group_topk", f"must be in [1, {groups}], got {keep}"))
        elif keep * per_group < topk:
            problems.append(("moe_router_group_topk",
                             f"{keep} groups x {per_group} experts per group < moe_router_topk={topk}"))
        return problems


def recompute_problems(modules: list[str]) -> list[str]:
    """What is wrong with a `recompute_modules` list, as messages."""
    choices = (FULL_RECOMPUTE, *SELECTIVE_RECOMPUTE)
    unknown = [m for m in modules if m not in choices]
    if unknown:
        return [f"unknown module(s) {', '.join(map(repr, unknown))}; choose from {', '.join(choices)}"]
    if FULL_RECOMPUTE in modules and len(set(modules)) > 1:
        return ["'full' recomputes the whole layer: give it alone"]
    return []
