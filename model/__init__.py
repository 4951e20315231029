"""The DeepSeek-V3 model family: norms, RoPE/YaRN, MLA, router, MoE, MTP, FLOP counts, HF interop.

No distributed code lives here; the MoE block talks to other ranks only through the dispatcher
object it is given (the default one is local).
"""
