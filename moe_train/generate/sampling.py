"""The next token from one position's logits: greedy (temperature 0) or nucleus sampling."""
from __future__ import annotations

import torch


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """argmax for temperature 0; else a draw from softmax(logits / temperature) restricted to the
    smallest set of most likely tokens whose probability reaches `top_p` (always at least one)."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # probability of the more likely tokens
        probs = torch.zeros_like(probs).scatter_(0, order, torch.where(before < top_p, sorted_probs, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))
