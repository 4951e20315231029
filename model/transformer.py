"""The DeepSeek-V3-family causal LM: embedding, decoder layers, final norm, head, MTP, losses.

One class serves the whole model and every pipeline stage (torchtitan's way): built for some
`ModelPart`s it holds only their modules, under the whole model's names (`layers.2.*` stays
`layers.2.*`), so initialisation, checkpoints and gradient reductions see the same keys in every
placement; its forward runs one part. The MTP depths embed tokens too, so a model holding the head
(with MTP) holds the embedding even where no part starts with it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from model.args import ModelArgs
from model.block import DecoderLayer
from model.dispatcher import Dispatcher, PackedExchange
from model.kv_cache import KVCache
from model.layers import GemmOps, GroupedLinear, Linear, RMSNorm
from model.moe import MoE, RoutedExperts
from model.mtp import IGNORE_INDEX, MTPLayer, shift_left
from model.rope import RotaryEmbedding
from model.router import Router


@dataclass(frozen=True)
class ModelPart:
    """A run of the forward: the embedding (else a given hidden state), decoder layers by global id,
    and the head (final norm, LM head, MTP and the losses)."""

    layers: tuple[int, ...]
    embedding: bool = True
    head: bool = True

    @classmethod
    def whole(cls, args: ModelArgs) -> ModelPart:
        return cls(tuple(range(args.num_layers)))


@dataclass
class ModelOutput:
    logits: torch.Tensor | None = None  # [B, T, V] of the main model, where the part has the head
    hidden: torch.Tensor | None = None  # [B, T, d] output of the part's last decoder layer (pre-norm)
    prediction_loss: torch.Tensor | None = None  # lm + mtp_scale * mtp, with its graph
    lm_loss: torch.Tensor | None = None
    mtp_loss: torch.Tensor | None = None  # mean over depths, unscaled
    aux_loss: torch.Tensor | None = None  # sum over the part's MoE layers of the sequence-wise balance loss

    @property
    def loss(self) -> torch.Tensor | None:
        """prediction_loss + aux_loss, what training backpropagates (the balance losses are values here:
        their gradients are injected in the MoE blocks). Added outside the forward, so that a
        compiled forward returns one differentiable scalar, whose backward gets a gradient."""
        return None if self.prediction_loss is None else self.prediction_loss + self.aux_loss


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over labels != IGNORE_INDEX, computed in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX)


class DeepSeekV3(nn.Module):
    """`model(input_ids, labels)`: labels[t] is the target of position t (already shifted).

    `parts` (default: the whole model) are what this instance holds and runs; `gemms` computes
    every weight GEMM (default: plain autograd; a pipeline passes its split-backward GEMMs).
    """

    def __init__(self, args: ModelArgs, dispatcher: Dispatcher | None = None, gemms: GemmOps | None = None,
                 parts: Sequence[ModelPart] | None = None) -> None:
        super().__init__()
        self.args = args
        self.parts = tuple(parts) if parts else (ModelPart.whole(args),)
        has_head = any(part.head for part in self.parts)
        if any(part.embedding for part in self.parts) or (has_head and args.mtp_num_layers):
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(args, moe=args.is_moe_layer(i), dispatcher=dispatcher)
                                     for part in self.parts for i in part.layers})
        if has_head:
            self.norm = RMSNorm(args.hidden_size, args.norm_epsilon)
            self.lm_head = Linear(args.hidden_size, args.vocab_size, args.init_method_std)
            self.mtp = nn.ModuleList(MTPLayer(args, dispatcher) for _ in range(args.mtp_num_layers))
        self.rotary = RotaryEmbedding(args)
        if hasattr(self, "embed_tokens"):
            nn.init.normal_(self.embed_tokens.weight, std=args.init_method_std)
        self.gemms = gemms or GemmOps()
        for module in self.modules():
            if isinstance(module, (Linear, GroupedLinear)):
                module.gemms = self.gemms
        if has_head:  # the output head (also MTP's) keeps high-precision GEMMs (DeepSeek-V3 §3.3)
            self.lm_head.gemms = self.gemms.high_precision()
        for experts in (m for m in self.modules() if isinstance(m, RoutedExperts)):  # their rows cross the dispatch
            experts.gate_up_proj.gemms = self.gemms.at_dispatch_boundary(inputs=True)
            experts.down_proj.gemms = self.gemms.at_dispatch_boundary(output_grads=True)

    def moe_blocks(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def routers(self) -> list[Router]:
        return [m.gate for m in self.moe_blocks()]

    def part_modules(self, part: ModelPart) -> list[nn.Module]:
        """The modules `forward(part=part)` runs; with MTP the head embeds tokens too."""
        modules: list[nn.Module] = [self.layers[str(i)] for i in part.layers]
        if part.embedding:
            modules.append(self.embed_tokens)
        if part.head:
            modules += [self.norm, self.lm_head, self.mtp]
            if len(self.mtp):
                modules.append(self.embed_tokens)
        return modules

    def _holds(self, part: ModelPart) -> bool:
        return (all(str(i) in self.layers for i in part.layers) and (not part.embedding or hasattr(self, "embed_tokens"))
                and (not part.head or hasattr(self, "lm_head")))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                hidden: torch.Tensor | None = None, part: ModelPart | None = None,
                mtp_loss_scale: float | None = None, aux_grad_scale: float | None = None,
                cache: KVCache | None = None, exchange: PackedExchange | None = None) -> ModelOutput:
        """Runs `part` (default: the one part this model holds): it starts from the embedding of
        `input_ids`, or from `hidden` where it starts after the embedding; with the head it gives the
        logits and, with `labels`, the losses (a part without the head gives only its balance loss).

        `aux_grad_scale`: the factor the loss is multiplied by before backward; a training forward
        with balance losses needs it. With `cache` (generation) input_ids are the tokens after the
        cached ones and MTP is not run; `exchange` moves the MoE tokens in the low-latency layout
        (decode steps)."""
        part = self._part(part)
        if part.embedding == (hidden is not None):
            raise ValueError(f"{part}: give `hidden` exactly where the part starts after the embedding")
        if labels is not None and cache is not None:
            raise ValueError("labels with a KV cache: the cache is for generation, losses need the whole sequence")
        start = 0 if cache is None else cache.length
        cos, sin = self.rotary(input_ids.shape[1], input_ids.device, start=start)
        if part.embedding:
            hidden = self.embed_tokens(input_ids)
        for i in part.layers:
            hidden = self.layers[str(i)](hidden, cos, sin, None if cache is None else cache.layers[i], exchange,
                                         aux_grad_scale)
        if not part.head:
            return ModelOutput(hidden=hidden, aux_loss=None if labels is None else self._aux_loss(part, hidden))
        logits = self.lm_head(self.norm(hidden))
        if labels is None:
            return ModelOutput(logits=logits, hidden=hidden)

        lm_loss = prediction_loss = token_cross_entropy(logits, labels)
        mtp_loss = torch.zeros((), device=logits.device)
        if self.mtp:  # (lm + scale * a zero constant would lose its graph under torch.compile, torch 2.13)
            mtp_loss = self._mtp_loss(hidden, input_ids, labels, cos, sin, aux_grad_scale)
            scale = self.args.mtp_loss_scaling_factor if mtp_loss_scale is None else mtp_loss_scale
            prediction_loss = lm_loss + scale * mtp_loss
        aux_loss = self._aux_loss(part, hidden)
        return ModelOutput(logits, hidden, prediction_loss, lm_loss.detach(), mtp_loss.detach(), aux_loss)

    def _part(self, part: ModelPart | None) -> ModelPart:
        if part is None:
            if len(self.parts) > 1:
                raise ValueError(f"this model holds {len(self.parts)} parts: pass the one to run as `part`")
            return self.parts[0]
        if not self._holds(part):
            raise ValueError(f"{part} needs modules this model does not hold (it holds {self.parts})")
        return part

    def _aux_loss(self, part: ModelPart, like: torch.Tensor) -> torch.Tensor:
        """The latest balance losses of the part's MoE blocks, summed (a value: see model.moe)."""
        blocks = [m for module in self.part_modules(part) for m in module.modules() if isinstance(m, MoE)]
        return sum((m.last_aux_loss for m in blocks), torch.zeros((), device=like.device))

    def _mtp_loss(self, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, aux_grad_scale: float | None) -> torch.Tensor:
        """Mean over MTP depths of the cross-entropy."""
        losses = []
        for depth, layer in enumerate(self.mtp, start=1):
            next_embedding = self.embed_tokens(shift_left(input_ids, depth, fill=0))
            hidden = layer(hidden, next_embedding, cos, sin, aux_grad_scale)
            logits = self.lm_head(layer.final_norm(hidden))
            losses.append(token_cross_entropy(logits, shift_left(labels, depth, fill=IGNORE_INDEX)))
        return torch.stack(losses).mean()
