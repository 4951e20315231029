"""DeepSeekMoE block: router, routed experts as grouped GEMMs, shared experts, dispatcher hook."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from model.args import ModelArgs
from model.dispatcher import Dispatcher, LocalDispatcher, PackedExchange, count_per_expert
from model.fp8 import Fp8Tensor
from model.layers import GroupEnds, GroupedLinear, SwiGLU, packed_swiglu
from model.recompute import Recompute
from model.router import Router, sequence_balance_loss


class AuxLossGradient(torch.autograd.Function):
    """Identity on the activation that also sends d(aux)=scale into the aux loss in backward.

    The balance loss then needs no path to the final loss (it may live on another pipeline
    stage); `scale` is the factor the main loss is multiplied by before its backward
    (1 / micro-batches), given with the forward.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_x, torch.full_like(aux_loss, ctx.scale), None


class SumByToken(torch.autograd.Function):
    """out[t] = the sum of the rows of `slots` that belong to token t: `index_add_`, whose backward
    gathers the output gradient by token. Autograd's own index_add keeps `slots` for its backward (only
    for its shape); this keeps the index alone."""

    @staticmethod
    def forward(ctx, slots: torch.Tensor, token: torch.Tensor, num_tokens: int) -> torch.Tensor:
        ctx.save_for_backward(token)
        return slots.new_zeros(num_tokens, slots.shape[1]).index_add_(0, token, slots)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (token,) = ctx.saved_tensors
        return grad.index_select(0, token), None, None


class RoutedExperts(nn.Module):
    """The experts this rank owns, as two grouped GEMMs (gate|up packed, then down)."""

    def __init__(self, num_local_experts: int, dim: int, hidden: int, init_std: float, first_expert: int = 0,
                 recompute: Recompute | None = None) -> None:
        """`recompute`: the decoder layer's (model.recompute), which rebuilds the activation under `moe_act`."""
        super().__init__()
        self.num_local_experts, self.hidden = num_local_experts, hidden
        self.recompute = recompute if recompute is not None else Recompute(())
        self.first_expert = first_expert  # global id of local expert 0 (experts are contiguous per rank)
        self.gate_up_proj = GroupedLinear(num_local_experts, dim, 2 * hidden, init_std)
        self.down_proj = GroupedLinear(num_local_experts, hidden, dim, init_std)

    def forward(self, x: torch.Tensor, local_idx: torch.Tensor, weights: torch.Tensor,
                per_expert: Sequence[int] | None, x_fp8: Fp8Tensor | None = None) -> torch.Tensor:
        """x [M, d]; local_idx [M, K] local expert ids or -1; returns sum_k w_k * expert_k(x) [M, d].
        `per_expert`: the slots of each local expert as the dispatcher counted them on the host, so that
        selecting the slots, and the grouped GEMMs that loop over the experts on the host, need no host
        sync; None where every slot is local (the one-process dispatcher; the GEMMs that need the
        counts then read them once).
        `x_fp8`: the FP8 rows x was dequantized from (the FP8 dispatch's), gathered per slot as x is,
        for the gate/up GEMM to take as its quantized input."""
        topk = local_idx.shape[1]
        flat_idx = local_idx.reshape(-1)
        # Slots by expert, in token order within an expert; slots of other ranks' experts sort last.
        num_slots = flat_idx.numel() if per_expert is None else sum(per_expert)
        order = torch.argsort(torch.where(flat_idx >= 0, flat_idx, self.num_local_experts), stable=True)[:num_slots]
        token_sorted = order // topk
        groups = GroupEnds.of_counts(count_per_expert(local_idx, self.num_local_experts), per_expert)
        slots_fp8 = None if x_fp8 is None else x_fp8.index_rows(token_sorted)
        gate_up = self.gate_up_proj(x.index_select(0, token_sorted), groups, slots_fp8)
        slot_weights = weights.reshape(-1)[order].unsqueeze(1).to(gate_up.dtype)
        out = self.down_proj.forward_activated(self._activation, gate_up, slot_weights, groups, self.recompute)
        return SumByToken.apply(out, token_sorted, x.shape[0]).to(x.dtype)

    @staticmethod
    def _activation(gate_up: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """SwiGLU of the packed gate|up rows, scaled by each slot's router weight (the narrower expert
        intermediate is scaled: down_proj is linear)."""
        return packed_swiglu(gate_up) * weights

    def forward_packed(self, x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """The masked grouped GEMM of DeepEP's low-latency layout: x [E_local, N, d] of which only the
        first count[e] rows of expert e hold tokens -> expert outputs [E_local, N, d], unweighted (the
        low-latency combine applies the router weights); only those rows are computed, the rest are 0."""
        valid = torch.arange(x.shape[1], device=x.device) < count.long().unsqueeze(1)  # [E_local, N]
        groups = GroupEnds.of_counts(count)
        out = self.down_proj(packed_swiglu(self.gate_up_proj(x[valid], groups)), groups)
        return out.new_zeros(*valid.shape, out.shape[-1]).index_put_((valid,), out)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, dispatcher: Dispatcher | None = None, recompute: Recompute | None = None) -> None:
        super().__init__()
        self.dispatcher = dispatcher or LocalDispatcher()
        self.num_experts = args.num_moe_experts
        self.aux_loss_coeff = args.moe_aux_loss_coeff
        local = self.dispatcher.local_experts(args.num_moe_experts)
        self.gate = Router(args, recompute)
        self.experts = RoutedExperts(len(local), args.hidden_size, args.moe_ffn_hidden_size,
                                     args.init_method_std, first_expert=local.start, recompute=recompute)
        self.shared_experts = None
        if args.moe_shared_expert_intermediate_size > 0:
            self.shared_experts = SwiGLU(args.hidden_size, args.moe_shared_expert_intermediate_size,
                                         args.init_method_std, recompute, shared_expert=True)
        self.last_aux_loss = torch.zeros(())  # value of the latest forward's balance loss, for logs

    def forward(self, x: torch.Tensor, exchange: PackedExchange | None = None,
                aux_grad_scale: float | None = None) -> torch.Tensor:
        """`exchange` (decoding): move the tokens with it in DeepEP's low-latency layout instead of the dispatcher.
        `aux_grad_scale`: the factor the loss is multiplied by before backward, which the balance loss
        gets as its gradient; a training forward with a balance loss needs it."""
        balance = self.training and self.aux_loss_coeff > 0 and torch.is_grad_enabled()
        if balance and aux_grad_scale is None:
            raise ValueError("a training forward with a balance loss (moe_aux_loss_coeff > 0) needs "
                             "aux_grad_scale: the factor the loss is multiplied by before backward "
                             "(1.0 for loss.backward(), 1 / micro-batches when they are averaged)")
        batch, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        routing = self.gate(flat)
        if exchange is not None:
            out = exchange.run_experts(flat, routing.topk_idx, routing.topk_weights, self.experts.forward_packed)
        else:
            layout = self.dispatcher.layout(routing.topk_idx, self.num_experts)
            recv_x, recv_idx, recv_weights, per_expert, handle = self.dispatcher.dispatch(
                flat, routing.topk_idx, routing.topk_weights, layout)
            expert_out = self.experts(recv_x, recv_idx, recv_weights, per_expert, self.dispatcher.take_fp8_rows(handle))
            out = self.dispatcher.combine(expert_out, handle)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        out = out.view(batch, seq, dim)
        self.last_aux_loss = torch.zeros((), device=x.device)
        if balance:
            aux = sequence_balance_loss(routing.scores, routing.topk_idx, batch, self.aux_loss_coeff)
            self.last_aux_loss = aux.detach()
            out = AuxLossGradient.apply(out, aux, aux_grad_scale)
        return out
