"""Text generation from a checkpoint: `python -m moe_train.generate` (`cli`), the KV-cache decode
loop (`decoding`) and token sampling (`sampling`).
"""
