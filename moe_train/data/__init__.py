"""Data: tokenizers, Megatron-compatible indexed datasets, packing and the resumable sampler."""
