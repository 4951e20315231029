"""Token-by-token generation with the KV cache: one prefill over the prompt through the model's
dispatcher (the normal dispatch), then one token per step with the MoE tokens moved by the decode
exchange (DeepEP's low-latency layout)."""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from model.dispatcher import PackedExchange
from model.kv_cache import KVCache
from model.transformer import DeepSeekV3


@torch.no_grad()
def generate_ids(model: DeepSeekV3, prompt_ids: list[int], max_new_tokens: int, choose: Callable[[torch.Tensor], int],
                 exchange: PackedExchange, stop_id: int | None = None) -> Iterator[int]:
    """Yields each new token as it is chosen (`choose`: the last position's logits [V] -> token id), at
    most `max_new_tokens`, ending after `stop_id`. Every EP rank must get the same tokens from `choose`."""
    device = model.embed_tokens.weight.device
    cache = KVCache(model.args, 1, len(prompt_ids) + max_new_tokens, device=device)
    logits = model(torch.tensor([prompt_ids], device=device), cache=cache).logits[0, -1]
    for step in range(max_new_tokens):
        token = choose(logits)
        yield token
        if token == stop_id or step == max_new_tokens - 1:
            return
        logits = model(torch.tensor([[token]], device=device), cache=cache, exchange=exchange).logits[0, -1]
