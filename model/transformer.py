"""The full DeepSeek-V3-family causal LM: embedding, decoder layers, final norm, head, MTP, losses."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.args import ModelArgs
from model.block import DecoderLayer
from model.dispatcher import Dispatcher, PackedExchange
from model.kv_cache import KVCache
from model.layers import Linear, RMSNorm
from model.moe import MoE
from model.mtp import IGNORE_INDEX, MTPLayer, shift_left
from model.rope import RotaryEmbedding
from model.router import Router


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V] of the main model
    loss: torch.Tensor | None = None  # lm + mtp_scale * mtp + aux (aux gradients flow via the MoE blocks)
    lm_loss: torch.Tensor | None = None
    mtp_loss: torch.Tensor | None = None  # mean over depths, unscaled
    aux_loss: torch.Tensor | None = None  # sum over MoE layers of the sequence-wise balance loss


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over labels != IGNORE_INDEX, computed in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX)


class DeepSeekV3(nn.Module):
    """`model(input_ids, labels)`: labels[t] is the target of position t (already shifted)."""

    def __init__(self, args: ModelArgs, dispatcher: Dispatcher | None = None) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(args, moe=args.is_moe_layer(i), dispatcher=dispatcher) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.norm_epsilon)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, args.init_method_std)
        self.mtp = nn.ModuleList(MTPLayer(args, dispatcher) for _ in range(args.mtp_num_layers))
        self.rotary = RotaryEmbedding(args)
        nn.init.normal_(self.embed_tokens.weight, std=args.init_method_std)

    def moe_blocks(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def routers(self) -> list[Router]:
        return [m.gate for m in self.moe_blocks()]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                mtp_loss_scale: float | None = None, cache: KVCache | None = None,
                exchange: PackedExchange | None = None) -> ModelOutput:
        """With `cache` (generation) input_ids are the tokens after the cached ones and MTP is not run;
        `exchange` moves the MoE tokens in the low-latency layout (decode steps)."""
        start = 0 if cache is None else cache.length
        cos, sin = self.rotary(input_ids.shape[1], input_ids.device, start=start)
        hidden = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, None if cache is None else cache.layers[i], exchange)
        logits = self.lm_head(self.norm(hidden))
        if labels is None:
            return ModelOutput(logits=logits)
        if cache is not None:
            raise ValueError("labels with a KV cache: the cache is for generation, losses need the whole sequence")

        lm_loss = token_cross_entropy(logits, labels)
        mtp_loss = self._mtp_loss(hidden, input_ids, labels, cos, sin)
        aux_loss = sum((m.last_aux_loss for m in self.moe_blocks()), torch.zeros((), device=logits.device))
        scale = self.args.mtp_loss_scaling_factor if mtp_loss_scale is None else mtp_loss_scale
        loss = lm_loss + scale * mtp_loss + aux_loss
        return ModelOutput(logits, loss, lm_loss.detach(), mtp_loss.detach(), aux_loss)

    def _mtp_loss(self, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return mtp_loss(self.mtp, self.embed_tokens, self.lm_head, hidden, input_ids, labels, cos, sin)


def mtp_loss(mtp: nn.ModuleList, embed_tokens: nn.Embedding | None, lm_head: Linear, hidden: torch.Tensor,
             input_ids: torch.Tensor, labels: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Mean over MTP depths of the cross-entropy; a function so a pipeline's last stage shares it (without
    MTP layers that stage holds no embedding: `embed_tokens` None)."""
    if not mtp:
        return torch.zeros((), device=hidden.device)
    assert embed_tokens is not None, "MTP layers need the token embedding"
    losses = []
    for depth, layer in enumerate(mtp, start=1):
        next_embedding = embed_tokens(shift_left(input_ids, depth, fill=0))
        hidden = layer(hidden, next_embedding, cos, sin)
        logits = lm_head(layer.final_norm(hidden))
        losses.append(token_cross_entropy(logits, shift_left(labels, depth, fill=IGNORE_INDEX)))
    return torch.stack(losses).mean()
