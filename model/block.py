"""One pre-norm decoder layer: h + MLA(norm(h)), then h + FFN(norm(h)) with a dense or MoE FFN."""
from __future__ import annotations

import torch
from torch import nn

from model.args import ModelArgs
from model.attention import MLA
from model.dispatcher import Dispatcher
from model.layers import RMSNorm, SwiGLU
from model.moe import MoE


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, moe: bool, dispatcher: Dispatcher | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.norm_epsilon)
        self.self_attn = MLA(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.norm_epsilon)
        if moe:
            self.mlp = MoE(args, dispatcher)
        else:
            self.mlp = SwiGLU(args.hidden_size, args.ffn_hidden_size, args.init_method_std)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))
