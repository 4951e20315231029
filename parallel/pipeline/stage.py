"""Pipeline stages of the DeepSeek-V3 model: which layers each stage runs, and its forward.

A stage is a range of decoder layers; the first stage also runs the embedding, the last one the
final norm, head, MTP and loss. The split comes from Megatron's layout string (`E` embedding,
`t` decoder layer, `m` MTP layer, `L` norm + head + loss, `|` between stages, `(...)*n` and
`x*n` repeat, `,` and spaces ignored; e.g. `Et|(tt|)*30mL`) or from first/last-stage layer
counts with the remaining layers spread evenly.

Each rank builds one `model.transformer.DeepSeekV3` holding the parts of all its stages, under
the single-process names, with the GEMMs split for the rank's W store; a `ModelStage` runs the
model's forward for its part and keeps the per-micro-batch loss record. Stages of one rank share its
modules: with a V placement (zbv, dualpipev) the embedding and the MTP of the last stage are one tensor.

Tied embedding: MTP depth k embeds token i+k, so the last stage needs the embedding. Where the
last stage sits on another rank than the first, that rank keeps a replica, initialised
identically, and its gradient is summed with the first stage's after the step (Megatron's
tied-embedding group, `parallel.pipeline.replicas`); both replicas then take the same update.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
from torch import nn

from model.args import ModelArgs
from model.dispatcher import Dispatcher
from model.transformer import DeepSeekV3, ModelPart

from .wgrad import WeightGradStore, split_gemms


@dataclass(frozen=True)
class StageSpec:
    """What one stage runs: global decoder-layer ids, and the model ends it owns."""

    layers: tuple[int, ...]
    embedding: bool = False
    mtp: int = 0
    loss: bool = False

    def __str__(self) -> str:
        return ("E" if self.embedding else "") + "t" * len(self.layers) + "m" * self.mtp + ("L" if self.loss else "")

    @property
    def part(self) -> ModelPart:
        """The stage as a part of the model (its MTP depths are the model's, all on the loss stage)."""
        return ModelPart(self.layers, embedding=self.embedding, head=self.loss)


def expand_layout(layout: str) -> str:
    """The layout with every repetition written out: `E(t|)*2L` -> `Et|t|L`."""
    text, end = _expand(layout.replace(",", "").replace(" ", ""), 0)
    if end != len(layout.replace(",", "").replace(" ", "")):
        raise ValueError(f"pipeline_layout: unbalanced ')' in {layout!r}")
    return text


def _expand(text: str, pos: int) -> tuple[str, int]:
    out = []
    while pos < len(text) and text[pos] != ")":
        if text[pos] == "(":
            unit, pos = _expand(text, pos + 1)
            if pos >= len(text):
                raise ValueError(f"pipeline_layout: missing ')' in {text!r}")
            pos += 1
        elif text[pos] in "Etm L|":
            unit, pos = text[pos], pos + 1
        else:
            raise ValueError(f"pipeline_layout: unexpected {text[pos]!r} in {text!r} (use E, t, m, L, |, (), *n)")
        if pos < len(text) and text[pos] == "*":
            digits = pos + 1
            while digits < len(text) and text[digits].isdigit():
                digits += 1
            if digits == pos + 1:
                raise ValueError(f"pipeline_layout: '*' without a count in {text!r}")
            unit, pos = unit * int(text[pos + 1:digits]), digits
        out.append(unit)
    return "".join(out), pos


def parse_layout(layout: str, args: ModelArgs, num_stages: int) -> list[StageSpec]:
    """Stages of a Megatron layout string, checked against the model and the stage count."""
    stages = expand_layout(layout).split("|")
    specs, next_layer = [], 0
    for text in stages:
        count = text.count("t")
        specs.append(StageSpec(tuple(range(next_layer, next_layer + count)), embedding="E" in text,
                               mtp=text.count("m"), loss="L" in text))
        next_layer += count
    problems = []
    if len(specs) != num_stages:
        problems.append(f"{len(specs)} stages, the schedule needs {num_stages}")
    if next_layer != args.num_layers:
        problems.append(f"{next_layer} 't' for num_layers={args.num_layers}")
    if "".join(stages).count("E") != 1 or not stages[0].startswith("E"):
        problems.append("exactly one 'E', at the start of the first stage")
    if "".join(stages).count("L") != 1 or not stages[-1].endswith("L"):
        problems.append("exactly one 'L', at the end of the last stage")
    if sum(s.mtp for s in specs) != args.mtp_num_layers or specs[:-1] and any(s.mtp for s in specs[:-1]):
        problems.append(f"{args.mtp_num_layers} 'm' (mtp_num_layers), all on the last stage")
    if any(not text for text in stages):
        problems.append("no empty stage")
    if problems:
        raise ValueError(f"pipeline_layout {layout!r}: needs " + "; ".join(problems))
    return specs


def even_stages(args: ModelArgs, num_stages: int, first: Optional[int] = None,
                last: Optional[int] = None) -> list[StageSpec]:
    """`first` layers on stage 0, `last` on the last stage, the rest evenly over the others."""
    counts: list[Optional[int]] = [None] * num_stages
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    if num_stages == 1 and first is not None and last is not None and first != last:
        raise ValueError("first and last stage layer counts differ but there is one stage")
    rest = args.num_layers - sum(c for c in counts if c is not None)
    free = counts.count(None)
    if any(c is not None and c < 0 for c in counts) or rest < 0 or (free == 0 and rest) or (free and rest % free):
        raise ValueError(f"cannot split {args.num_layers} layers into {num_stages} stages "
                         f"(first {first}, last {last}); give parallel.pipeline_layout")
    counts = [rest // free if c is None else c for c in counts]
    starts = [sum(counts[:i]) for i in range(num_stages)]
    return [StageSpec(tuple(range(start, start + count)), embedding=i == 0,
                      mtp=args.mtp_num_layers if i == num_stages - 1 else 0, loss=i == num_stages - 1)
            for i, (start, count) in enumerate(zip(starts, counts))]


def stage_specs(args: ModelArgs, num_stages: int, layout: Optional[str] = None, first: Optional[int] = None,
                last: Optional[int] = None) -> list[StageSpec]:
    """The model cut into `num_stages` stages: by layout string, else by layer counts."""
    if layout is not None:
        if first is not None or last is not None:
            raise ValueError("give either a pipeline layout or first/last stage layer counts, not both")
        return parse_layout(layout, args, num_stages)
    return even_stages(args, num_stages, first, last)


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the stages take it: the tokens, their targets, and the factors of its loss."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_scale: Optional[float] = None  # what the loss is multiplied by before backward (a training forward needs it)
    mtp_loss_scale: Optional[float] = None  # None: the model's mtp_loss_scaling_factor


class ModelStage:
    """One stage for the runtime: the model's forward of the stage's part, and the loss parts of
    every micro-batch.

    `inputs` of a micro-batch is a `MicroBatch`. A stage that is not the last returns its hidden
    state; the last returns `(lm_loss + mtp_loss_scale * mtp_loss) * loss_scale`, what backward
    starts from, as the single-process `(out.loss * scale).backward()` (balance losses reach their
    gradients through `model.moe.AuxLossGradient`, so they need no path to this loss).
    """

    def __init__(self, model: DeepSeekV3, spec: StageSpec) -> None:
        self.model, self.spec, self.part = model, spec, spec.part
        self.parts: dict[int, torch.Tensor] = {}  # micro-batch -> [lm, mtp, aux], until popped

    @property
    def is_first(self) -> bool:
        return self.spec.embedding

    @property
    def is_last(self) -> bool:
        return self.spec.loss

    def modules(self) -> list[nn.Module]:
        """The modules this stage's forward runs."""
        return self.model.part_modules(self.part)

    def parameters(self) -> list[nn.Parameter]:
        return [p for module in self.modules() for p in module.parameters()]

    def forward(self, microbatch: int, x: Optional[torch.Tensor], inputs: MicroBatch) -> torch.Tensor:
        out = self.model(inputs.input_ids, inputs.labels, hidden=x, part=self.part,
                         mtp_loss_scale=inputs.mtp_loss_scale, aux_grad_scale=inputs.loss_scale)
        zero = out.aux_loss.new_zeros((), dtype=torch.float64)
        lm, mtp = (out.lm_loss.double(), out.mtp_loss.double()) if self.is_last else (zero, zero)
        self.parts[microbatch] = torch.stack([lm, mtp, out.aux_loss.detach().double()])
        if not self.is_last:
            return out.hidden
        return out.prediction_loss if inputs.loss_scale is None else out.prediction_loss * inputs.loss_scale

    def pop_parts(self) -> dict[int, torch.Tensor]:
        """Per micro-batch [lm_loss, mtp_loss, aux_loss] (zeros where this stage has no such part)."""
        parts, self.parts = self.parts, {}
        return parts


def build_stages(args: ModelArgs, specs: Sequence[StageSpec], stage_ids: Iterable[int], store: WeightGradStore,
                 dispatcher: Dispatcher | None = None, fp8: bool = False) -> tuple[DeepSeekV3, dict[int, ModelStage]]:
    """This rank's model (the parts of its stages, weight GEMMs split for `store`, in FP8 with `fp8`)
    and a `ModelStage` for each of its stage ids."""
    stage_ids = sorted(stage_ids)
    model = DeepSeekV3(args, dispatcher, split_gemms(store, fp8), [specs[s].part for s in stage_ids])
    return model, {s: ModelStage(model, specs[s]) for s in stage_ids}
