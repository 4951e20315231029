"""One pre-norm decoder layer: h + MLA(norm(h)), then h + FFN(norm(h)) with a dense or MoE FFN.

`recompute_modules` (model.recompute): with `full` the layer keeps only its input for backward and
runs its forward again there (torch.utils.checkpoint, non-reentrant); the replay routes identically,
so the balance-loss gradient is injected once and expert loads are counted twice for every expert
alike, which changes neither the sign-based bias update nor the max/mean load ratio. The selective
modules rebuild only their regions (norms, MLA up-projections, the experts' activation), never the
router, a dispatch or a combine, so expert loads are counted once.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.attention import MLA
from model.dispatcher import Dispatcher, PackedExchange
from model.kv_cache import LayerKVCache
from model.layers import RMSNorm, SwiGLU
from model.moe import MoE
from model.args import FULL_RECOMPUTE, ModelArgs
from model.recompute import Recompute


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, moe: bool, dispatcher: Dispatcher | None = None) -> None:
        super().__init__()
        self.full_recompute = FULL_RECOMPUTE in args.recompute_modules
        self.recompute = Recompute(args.recompute_modules)
        self.input_layernorm = RMSNorm(args.hidden_size, args.norm_epsilon, self.recompute)
        self.self_attn = MLA(args, self.recompute)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.norm_epsilon, self.recompute)
        if moe:
            self.mlp = MoE(args, dispatcher, self.recompute)
        else:
            self.mlp = SwiGLU(args.hidden_size, args.ffn_hidden_size, args.init_method_std, self.recompute)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerKVCache | None = None,
                exchange: PackedExchange | None = None, aux_grad_scale: float | None = None) -> torch.Tensor:
        """`cache`: decoding (see model.attention); `exchange`: the MoE block moves its tokens with it
        (DeepEP's low-latency layout, see model.moe) instead of its dispatcher; `aux_grad_scale`: the
        balance loss's gradient (see model.moe.MoE)."""
        if self.full_recompute and torch.is_grad_enabled():
            return checkpoint(self._forward, h, cos, sin, cache, exchange, aux_grad_scale, use_reentrant=False)
        with self.recompute.active():
            return self._forward(h, cos, sin, cache, exchange, aux_grad_scale)

    def _forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerKVCache | None,
                 exchange: PackedExchange | None, aux_grad_scale: float | None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache)
        x = self.post_attention_layernorm(h)
        return h + (self.mlp(x, exchange, aux_grad_scale) if isinstance(self.mlp, MoE) else self.mlp(x))
