"""A `deep_ep`-compatible surface over kernels_cuda: DeepEP's `Buffer`, `Config`, `EventOverlap`,
`EventHandle`, `topk_idx_t` and `deep_ep.utils`, with DeepEP's signatures, defaults and return shapes
(tuple handles), so code written for DeepEP (Megatron-core's `fused_a2a`, torchtitan's DeepEP
dispatcher) runs on our kernels unchanged, on a GPU or on the CPU emulation.

Use it in place of DeepEP with one line before that code imports `deep_ep`:

    import kernels_cuda.deep_ep; kernels_cuda.deep_ep.install()   # `import deep_ep` now gives this module

or import it under the name directly: `from kernels_cuda import deep_ep`. `kernels_cuda.deep_ep.buffer`
lists where it differs from DeepEP.
"""
from __future__ import annotations

import sys

import torch

from kernels_cuda.deep_ep import utils
from kernels_cuda.deep_ep.buffer import Buffer
from kernels_cuda.deep_ep.config import Config
from kernels_cuda.deep_ep.utils import EventHandle, EventOverlap

topk_idx_t = torch.int64  # the dtype of topk_idx (DeepEP's `topk_idx_t`)


def install() -> None:
    """Registers this module as `deep_ep` (and `deep_ep.utils`) in sys.modules."""
    sys.modules["deep_ep"] = sys.modules[__name__]
    sys.modules["deep_ep.utils"] = utils


__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "install", "topk_idx_t", "utils"]
