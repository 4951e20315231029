"""The decoding cache of MLA: per layer the normalized compressed latent (kv_lora_rank) and the
rotated shared RoPE key (qk_pos_emb_head_dim) of every token so far, as DeepSeek's inference code
keeps them (576 numbers per token and layer for DeepSeek-V3, instead of 128 heads x 320)."""
from __future__ import annotations

import torch

from model.args import ModelArgs


class LayerKVCache:
    """Preallocated [B, max_len, ...] buffers of one layer; `append` writes the next tokens."""

    def __init__(self, batch: int, max_len: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.latent = torch.zeros(batch, max_len, kv_lora_rank, dtype=dtype, device=device)
        self.k_pe = torch.zeros(batch, max_len, rope_dim, dtype=dtype, device=device)
        self.length = 0

    def append(self, latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store latent [B, T, r] and k_pe [B, T, d_rope]; returns every cached token's ([B, S, r], [B, S, d_rope])."""
        end = self.length + latent.shape[1]
        if end > self.latent.shape[1]:
            raise ValueError(f"KV cache of {self.latent.shape[1]} positions cannot take {end}")
        self.latent[:, self.length:end] = latent
        self.k_pe[:, self.length:end] = k_pe
        self.length = end
        return self.latent[:, :end], self.k_pe[:, :end]


class KVCache:
    """One `LayerKVCache` per decoder layer (MTP layers are not cached: generation ignores them)."""

    def __init__(self, args: ModelArgs, batch: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.max_len = max_len
        self.layers = [LayerKVCache(batch, max_len, args.kv_lora_rank, args.qk_pos_emb_head_dim, dtype, device)
                       for _ in range(args.num_layers)]

    @property
    def length(self) -> int:
        """Tokens cached so far: the position of the next token."""
        return self.layers[0].length if self.layers else 0
