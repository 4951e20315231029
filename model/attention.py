"""Multi-head Latent Attention (MLA): the training ("naive") form with a causal mask, and with a
`LayerKVCache` the decoding form.

With a cache, the normalized latent and the rotated RoPE key of the new tokens are appended. The
first call on an empty cache (prefill) then runs the naive form over its tokens; later calls
(decode) run DeepSeek's absorbed form over the cache: W_UK (the k_nope rows of kv_b_proj) is folded
into the query and W_UV (its v rows) into the output, so attention reads the cached latent directly
and never expands per-head keys or values.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.args import ModelArgs
from model.kv_cache import LayerKVCache
from model.layers import Linear, RMSNorm
from model.recompute import Recompute
from model.rope import apply_rope, softmax_scale


class MLA(nn.Module):
    """Low-rank q path (with its norm), compressed kv path with one shared RoPE key head."""

    def __init__(self, args: ModelArgs, recompute: Recompute | None = None) -> None:
        """`recompute`: the decoder layer's (model.recompute): its latent norms under `layernorm`,
        q, k and v under `mla_up_proj`."""
        super().__init__()
        self.recompute = recompute if recompute is not None else Recompute(())
        d, heads, std = args.hidden_size, args.num_attention_heads, args.init_method_std
        self.num_heads = heads
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_head_dim, args.qk_pos_emb_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        if args.q_lora_rank is None:
            self.q_proj = Linear(d, heads * qk_dim, std, recompute)
        else:
            self.q_a_proj = Linear(d, args.q_lora_rank, std, recompute)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, args.norm_epsilon, recompute)
            self.q_b_proj = Linear(args.q_lora_rank, heads * qk_dim, std, recompute)
        self.kv_a_proj_with_mqa = Linear(d, args.kv_lora_rank + self.rope_dim, std, recompute)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, args.norm_epsilon, recompute)
        self.kv_b_proj = Linear(args.kv_lora_rank, heads * (self.nope_dim + self.v_dim), std, recompute)
        self.o_proj = Linear(heads * self.v_dim, d, std, recompute)
        self.softmax_scale = softmax_scale(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerKVCache | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q_input = x if hasattr(self, "q_proj") else self.q_a_layernorm(self.q_a_proj(x))
        compressed, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(compressed)
        if cache is not None:
            start = cache.length
            cached_latent, cached_k_pe = cache.append(latent, _rotated_key(k_pe, cos, sin).squeeze(1))
            if start > 0:
                q_nope, q_pe = self._queries(q_input, cos, sin)
                out = self._absorbed_attention(q_nope, q_pe, cached_latent, cached_k_pe, start)
                return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.v_dim))
        q, k, v = self.recompute.region("mla_up_proj", self._up_project, q_input, latent, k_pe, cos, sin)
        out = self.recompute.compact_saved_output(
            "mla_up_proj", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale),
            self._heads_last, self._padded_heads)
        return self.o_proj(out)

    def _heads_last(self, out: torch.Tensor) -> torch.Tensor:
        """The attention core's output [B, H, T, qk] -> o_proj's input [B, T, H * v_dim]: the padding of v
        (zeros in the output too) cut off."""
        batch, _, seq, _ = out.shape
        return out[..., :self.v_dim].transpose(1, 2).reshape(batch, seq, self.num_heads * self.v_dim)

    def _padded_heads(self, heads_last: torch.Tensor, out: torch.Tensor) -> None:
        """`_heads_last`'s inverse, written into `out` [B, H, T, qk] (whatever its strides): the core's
        output, v's padding channels zero."""
        batch, seq, _ = heads_last.shape
        out[..., :self.v_dim].copy_(heads_last.view(batch, seq, self.num_heads, self.v_dim).transpose(1, 2))
        out[..., self.v_dim:].zero_()

    def _queries(self, q_input: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q_nope [B, H, T, d_nope] and the rotated q_pe [B, H, T, d_rope] from the q latent (or x)."""
        batch, seq, _ = q_input.shape
        up = self.q_proj if hasattr(self, "q_proj") else self.q_b_proj
        q = up(q_input).view(batch, seq, self.num_heads, -1).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        return q_nope, apply_rope(q_pe, cos, sin)

    def _up_project(self, q_input: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention core's q, k and v [B, H, T, qk], v zero-padded to the qk head dim (so fused
        kernels apply), from the q latent, the normalised kv latent and the unrotated k_pe."""
        batch, seq, _ = latent.shape
        q_nope, q_pe = self._queries(q_input, cos, sin)
        kv = self.kv_b_proj(latent).view(batch, seq, self.num_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        k = torch.cat((k_nope, _rotated_key(k_pe, cos, sin).expand(-1, self.num_heads, -1, -1)), dim=-1)
        return q, k, F.pad(v, (0, q.shape[-1] - self.v_dim))

    def _absorbed_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                            k_pe: torch.Tensor, start: int) -> torch.Tensor:
        """q_nope [B, H, T, d_nope] and rotated q_pe [B, H, T, d_rope] of tokens at positions start..start+T-1
        against the cached latent [B, S, r] and k_pe [B, S, d_rope] (S = start + T) -> [B, H, T, d_v]."""
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w_kv.split([self.nope_dim, self.v_dim], dim=1)
        q_latent = torch.einsum("bhtd,hdc->bhtc", q_nope, w_uk)
        scores = (torch.einsum("bhtc,bsc->bhts", q_latent, latent)
                  + torch.einsum("bhtr,bsr->bhts", q_pe, k_pe)) * self.softmax_scale
        queries = torch.arange(start, start + q_nope.shape[2], device=latent.device)
        visible = torch.arange(latent.shape[1], device=latent.device) <= queries.unsqueeze(1)  # [T, S] causal
        probs = scores.float().masked_fill(~visible, float("-inf")).softmax(dim=-1).to(latent.dtype)
        return torch.einsum("bhtc,hdc->bhtd", torch.einsum("bhts,bsc->bhtc", probs, latent), w_uv)


def _rotated_key(k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The one RoPE key head shared by all heads, [B, T, d_rope] -> rotated [B, 1, T, d_rope]."""
    return apply_rope(k_pe.unsqueeze(1), cos, sin)
