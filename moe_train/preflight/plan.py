"""Check a run's parallel layout and memory for a cluster before anything starts.

    python -m moe_train.plan --config FILE [--set section.key=value ...] --nodes N --gpus-per-node G
        [--gpu-memory-gib M] [--reserve-gib R]

Validates the config and the layout (parallel.topology.layout_problems, the launcher's batch
check, the pipeline schedule's requirements), then prints per pipeline rank: parameters (stage
split in moe_train/preflight/plan_stages.py; routed experts divided over ep), weights, fp32 main parameters,
gradients and Adam state, peak activations (the simulated schedule's F/backward order times the
per-stage activation estimate), the simulated bubble, and the expert-dispatch traffic per step
(moe_train/preflight/plan_traffic.py).

Memory per rank, as the trainer keeps it (parameter_bytes): the weights (fp32, or bf16 with
train.precision=bf16 and fp8) and their fp32 gradients (main gradients of bf16 parameters,
parallel.mixed_precision), both for every element the pipeline rank holds; with fp8 also the FP8
copy of each weight its GEMMs take (plan_stages.fp8_weight_copy_bytes), counted with the weights:
made once per step and held through it like them, not per micro-batch; fp32 main parameters (bf16
parameters only) and Adam's two moments (fp32, or bf16 with optim.moment_dtype) of the data-parallel
rank's ZeRO-1 shard, an even split of each replica group's elements (zero1_shard_elements: dense
parameters over dp, experts over expert-dp, both over twice as many ranks where two pipeline ranks
hold the same parameters), and a step count per tensor (a bound: a shard may not touch every
tensor); activations as moe_train/preflight/plan_stages.py models them; the native dispatcher's buffers; and
--reserve-gib for the CUDA context, NCCL's buffers and allocator fragmentation.
model.recompute_modules lowers what each decoder layer keeps (moe_train/preflight/plan_stages.py): with
[full] a stage stores the layer inputs plus one layer's activations at a time. Exit 2 with every
problem named by its config key when the layout cannot work, or when --gpu-memory-gib is given and
a rank does not fit.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from model.args import FULL_RECOMPUTE
from model.flops import count_parameters
from moe_train.batch_ramp import batch_ramp
from moe_train.config import Config, ConfigError, load_config
from moe_train.preflight.layout import layout_errors
from moe_train.preflight.memory_limits import MemoryLimit
from moe_train.preflight.pipeline import choose_schedule, ramp_schedules
from moe_train.preflight.plan_stages import (RankParameters, Stage, bf16_parameters, build_stages,
                                             fp8_weight_copy_bytes, layer_memory, rank_parameters,
                                             stage_activation_bytes)
from moe_train.preflight.plan_traffic import communication_buffer_bytes, expected_routing, token_traffic
from parallel.adamw import MOMENT_DTYPES
from parallel.pipeline.builders import build
from parallel.pipeline.ir import ActionKind, Schedule
from parallel.pipeline.replicas import replica_pairs
from parallel.pipeline.timeline import Timeline, simulate

GIB = 2 ** 30


@dataclass(frozen=True)
class RankPlan:
    """One pipeline rank (every dp / ep rank of a stage holds the same amounts)."""

    pp_rank: int
    stages: tuple[int, ...]
    dense_params: int  # replicated over dp, includes an embedding copy when MTP needs one here
    expert_params: int  # this rank's share of the routed experts
    weights: float  # bytes of the model's parameters (fp32: they are the master weights) and fp8's weight copies
    main_params: float  # bytes of the fp32 main parameters of the ZeRO-1 shard beside bf16 weights (fp32: none)
    grads: float  # bytes of the fp32 gradients the optimizer reads (main gradients of bf16 weights)
    optimizer: float  # bytes of Adam's moments of the ZeRO-1 shard and its step counts
    activations: float  # bytes at the simulated peak
    buffers: float  # bytes of the dispatcher's communication buffers (plan_traffic.communication_buffer_bytes)
    peak_units: float  # simulator's peak, in one stage's activations of one micro-batch
    inter_node: tuple[float, float]  # dispatch bytes per step, (BF16 dispatch, FP8 dispatch)
    intra_node: tuple[float, float]

    @property
    def params(self) -> int:
        return self.dense_params + self.expert_params

    @property
    def total(self) -> float:
        return self.weights + self.main_params + self.grads + self.optimizer + self.activations + self.buffers


@dataclass(frozen=True)
class ClusterPlan:
    config: Config
    nodes: int
    gpus_per_node: int
    microbatches: int
    stages: list[Stage]
    timeline: Timeline
    ranks: list[RankPlan]
    recompute: tuple[str, ...]

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.world // self.config.parallel.pp

    @property
    def bubble_fraction(self) -> float:
        return self.timeline.bubble / self.timeline.makespan


def _layout_problems(config: Config, nodes: int, gpus_per_node: int) -> list[tuple[str, str]]:
    p = config.parallel
    problems = []
    for key, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
        if value < 1:
            problems.append((key, f"must be >= 1, got {value}"))
    if problems:
        return problems
    for key, value in (("parallel.gpus_per_node", p.gpus_per_node), ("parallel.nproc_per_node", p.nproc_per_node)):
        if value is not None and value != gpus_per_node:
            problems.append((key, f"{value} does not match the cluster's {gpus_per_node} GPUs per node"))
    return problems or layout_errors(config, nodes, gpus_per_node)


def _schedule(config: Config, dp: int) -> Schedule:
    """The schedule the run settles to (zb-auto: searched with the builder's default costs)."""
    choice = choose_schedule(config, dp, warm_up=False)
    if choice.pp == 1:
        return build("1f1b", 1, choice.microbatches)
    try:
        return build(choice.name, choice.pp, choice.microbatches, choice.virtual_stages, choice.costs,
                     choice.memory_limit)
    except ValueError as err:
        raise ConfigError([("parallel.schedule", f"{choice.name} over pp={choice.pp} with {choice.microbatches} "
                                                 f"micro-batches per step (global batch / (micro-batch x dp={dp})): "
                                                 f"{err}")]) from None


def _stage_activation_bytes(config: Config, stage: Stage) -> tuple[float, float]:
    """moe_train/preflight/plan_stages.py's per-micro-batch bytes of `stage` under the run's config."""
    a, t = config.model, config.train
    return stage_activation_bytes(a, stage, t.micro_batch_size * t.seq_length, t.precision,
                                  a.num_moe_experts // config.parallel.ep)


def _peak_activation_bytes(program, per_stage: dict[int, tuple[float, float]], mem_b: float) -> float:
    """The simulator's memory walk (Costs.memory) weighted by each stage's bytes."""
    live = peak = 0.0
    for action in program:
        halves = action.halves()
        for half in halves:
            if half.kind is ActionKind.F:
                live += per_stage[half.stage][0]
        working = max((per_stage[h.stage][1] for h in halves if h.kind is not ActionKind.F), default=0.0)
        peak = max(peak, live + working)
        for half in halves:
            kept = per_stage[half.stage][0]
            live -= {ActionKind.B: mem_b * kept, ActionKind.W: (1 - mem_b) * kept,
                     ActionKind.BW: kept}.get(half.kind, 0.0)
    return peak


def moment_bytes(config: Config) -> int:
    """Bytes of Adam's two moments per parameter element: 8 in fp32, 4 in bf16 (optim.moment_dtype)."""
    return 2 * MOMENT_DTYPES[config.optim.moment_dtype].itemsize


def parameter_bytes(config: Config) -> tuple[int, int, int]:
    """Bytes per parameter element of (the weights, their gradients, fp32 main parameters), as
    parallel.mixed_precision keeps them. train.precision=bf16 (and fp8): bf16 weights (2), fp32 main gradients
    (4) of every element, fp32 main parameters (4) of the elements the rank's optimizer steps. fp32:
    the weights (4) are their own main parameters (0), `.grad` their gradients (4)."""
    return (2, 4, 4) if bf16_parameters(config.train.precision) else (4, 4, 0)


def zero1_shard_elements(elements: int, members: int) -> int:
    """Elements of `elements` that one of `members` ranks owns under ZeRO-1, as Megatron's distributed
    optimizer cuts them: the group's parameters lie in contiguous gradient buffers cut into buckets,
    each padded to a multiple of `members` and split evenly in element ranges (tensors cut anywhere),
    so every member owns ceil(elements / members). The padding, at most one element per bucket and
    member, is not counted."""
    return -(-elements // members)


def owned_elements(params: RankParameters, dp: int, ep: int, zero1: bool, pair: int, embedding_pair: int) -> int:
    """Elements of `params` whose main parameters and moments one data-parallel rank keeps: with
    ZeRO-1 its shard of each replica group (dense parameters over dp, routed experts over expert-dp =
    dp / ep, each times `pair`, 2 where the pipeline rank's parameters are replicated on a second one:
    DualPipe's mirror; the embedding times `embedding_pair`, 2 also for the tied replica of a loop
    placement with MTP); without ZeRO-1 all of them."""
    if not zero1:
        return params.dense + params.expert
    return (zero1_shard_elements(params.dense - params.embedding, pair * dp)
            + zero1_shard_elements(params.embedding, embedding_pair * dp)
            + zero1_shard_elements(params.expert, pair * (dp // ep)))


def optimizer_bytes(config: Config, params: RankParameters, owned: int) -> int:
    """Adam's state of a rank: the two moments of the `owned` elements and an fp32 step count per tensor
    (parallel.adamw); under ZeRO-1 the step counts are a bound, a shard may touch fewer tensors."""
    return moment_bytes(config) * owned + 4 * params.tensors


def make_plan(config: Config, nodes: int, gpus_per_node: int) -> ClusterPlan:
    """The per-rank plan; raises ConfigError listing every layout problem."""
    problems = _layout_problems(config, nodes, gpus_per_node)
    if problems:
        raise ConfigError(problems, f"{nodes} node(s) x {gpus_per_node} GPU(s)")
    p, t, a = config.parallel, config.train, config.model
    world = nodes * gpus_per_node
    dp = world // p.pp
    schedule = _schedule(config, dp)
    # the batch ramp's smaller steps: memory is planned at the largest peak over them and the final batch
    # (a schedule's peak need not grow with its micro-batches: zb-interleaved's does not)
    ramp = ramp_schedules(config, dp, warm_up=False) if p.pp > 1 else []
    try:
        stages = build_stages(a, schedule.num_stages, p.pipeline_layout, p.first_stage_layers, p.last_stage_layers)
    except ValueError as err:
        raise ConfigError([("parallel.pipeline_layout" if p.pipeline_layout else "parallel.pp", str(err))]) from None
    timeline = simulate(schedule)
    per_stage = {s.index: _stage_activation_bytes(config, s) for s in stages}
    mem_b = timeline.costs.mem_b
    units = {s.index: (1.0, 0.0) for s in stages}  # one stage-micro-batch each: the walk counts the peak in units
    tokens = t.micro_batch_size * t.seq_length
    traffic = [token_traffic(a, p.ep, gpus_per_node, fp8) for fp8 in (False, True)]
    buffers = communication_buffer_bytes(config, gpus_per_node)
    weight, grad, main = parameter_bytes(config)
    pairs, mirror = replica_pairs(schedule.placement, tied_embedding=a.mtp_num_layers > 0)
    ranks = []
    for rank, program in enumerate(schedule.programs):
        on_rank = schedule.placement.stages_on(rank)
        rank_stages = [stages[s] for s in on_rank]
        params = rank_parameters(a, rank_stages, p.ep)
        copies = fp8_weight_copy_bytes(a, rank_stages, p.ep) if t.precision == "fp8" else 0
        paired = any(rank in pair for pair in pairs)
        owned = owned_elements(params, dp, p.ep, p.zero1, 2 if paired and mirror else 1, 2 if paired else 1)
        moe_tokens = sum(tokens * stages[half.stage].moe_layers
                         for action in program for half in action.halves() if half.kind is ActionKind.F)
        ranks.append(RankPlan(
            pp_rank=rank, stages=on_rank, dense_params=params.dense, expert_params=params.expert,
            weights=weight * (params.dense + params.expert) + copies, main_params=main * owned,
            grads=grad * (params.dense + params.expert), optimizer=optimizer_bytes(config, params, owned),
            activations=max(_peak_activation_bytes(s.programs[rank], per_stage, mem_b) for s in (schedule, *ramp)),
            buffers=buffers,
            peak_units=max([timeline.peak_activations[rank], *(_peak_activation_bytes(s.programs[rank], units, mem_b)
                                                               for s in ramp)]),
            inter_node=tuple(moe_tokens * x.inter_node for x in traffic),
            intra_node=tuple(moe_tokens * x.intra_node for x in traffic)))
    return ClusterPlan(config, nodes, gpus_per_node, schedule.num_microbatches, stages, timeline, ranks,
                       tuple(a.recompute_modules))


# What recomputation to suggest when activations do not fit, lightest first (each unless already set).
RECOMPUTE_HINTS = ((("layernorm", "mla_up_proj", "moe_act"), "[layernorm,mla_up_proj,moe_act]"),
                   ((FULL_RECOMPUTE,), "[full]"))


def fit_problems(plan: ClusterPlan, gpu_memory_gib: float, reserve_gib: float) -> list[tuple[str, str]]:
    """One problem per distinct overflow, naming the pipeline ranks and their largest memory part."""
    overflows: dict[tuple[float, str, float], list[int]] = {}
    for rank in plan.ranks:
        need = rank.total / GIB + reserve_gib
        if need > gpu_memory_gib:
            part, size = max(("parameters + gradients", rank.weights + rank.main_params + rank.grads),
                             ("optimizer state", rank.optimizer), ("activations", rank.activations),
                             key=lambda item: item[1])
            overflows.setdefault((round(need, 1), part, round(size / GIB, 1)), []).append(rank.pp_rank)
    problems = []
    lighter = [f"model.recompute_modules={option}" for modules, option in RECOMPUTE_HINTS
               if not set(modules) <= set(plan.recompute)]
    if plan.config.train.precision != "fp8":  # FP8 GEMMs keep their inputs in FP8
        lighter.insert(0, "train.precision=fp8")
    for (need, part, size), ranks in overflows.items():
        hint = (f"try {' or '.join(lighter) + ', ' if lighter else ''}a smaller train.micro_batch_size or "
                "train.seq_length" if part == "activations" else "try more pipeline stages or a larger parallel.ep")
        problems.append(("--gpu-memory-gib", f"pp rank(s) {','.join(map(str, ranks))} need {need:.1f} GiB "
                                             f"> {gpu_memory_gib:g} GiB; largest part: {part} {size:.1f} GiB ({hint})"))
    return problems


def start_up_memory_problems(config: Config, world: int, available: MemoryLimit, memory: str) -> list[tuple[str, str]]:
    """A lower bound of one process's memory against `available`, what `memory` (e.g. "cpu memory")
    offers each process here (moe_train.preflight.memory_limits): checked at start-up, before the model is allocated. Cheap and analytical
    (make_plan builds the stages' modules, too slow for a model that is far too large): weights,
    gradients, main parameters and Adam moments (parameter_bytes and moment_bytes: 16 bytes per
    parameter in fp32, 12 with bf16 moments; 18 and 14 with bf16 parameters; with fp8 also the FP8
    copy of each routed expert weight, 1 byte per element, the bulk of the step's FP8 weight copies)
    as if spread evenly over all `world` processes, plus one micro-batch's activations of the first
    stage's layers unless they are recomputed, plus the token rows of a step's micro-batches on this
    rank (int64, read before the step starts)."""
    a, t, pp = config.model, config.train, config.parallel.pp
    counts = count_parameters(a)
    states = (sum(parameter_bytes(config)) + moment_bytes(config)) * (counts.total + counts.mtp_total) / world
    if t.precision == "fp8":
        moe_layers = sum(map(a.is_moe_layer, range(a.num_layers))) + a.mtp_num_layers * (a.num_moe_experts > 0)
        states += 3 * a.hidden_size * a.moe_ffn_hidden_size * a.num_moe_experts * moe_layers / world
    activations = 0.0
    if FULL_RECOMPUTE not in config.model.recompute_modules:
        tokens = t.micro_batch_size * t.seq_length
        experts = max(1, a.num_moe_experts // config.parallel.ep)
        first = range(-(-a.num_layers // pp))
        activations = sum(layer_memory(a, a.is_moe_layer(i), tokens, t.precision, experts).kept
                          for i in first)
    rows = 8 * (t.seq_length + 1) * t.global_batch_size / max(1, world // pp)
    need = (states + activations + rows) / GIB
    if need <= available.gib:
        return []
    return [("memory", f"{memory}: each process needs at least {need:.1f} GiB (parameters, gradients, main "
                       f"parameters and Adam state {states / GIB:.1f} GiB, one micro-batch's activations "
                       f"{activations / GIB:.1f} GiB, a step's token rows {rows / GIB:.1f} GiB) "
                       f"but {available.gib:.1f} GiB is available per process, bounded by {available.source}; use a smaller model, more processes, "
                       "model.recompute_modules=[full], or a smaller train.micro_batch_size, train.global_batch_size or "
                       "train.seq_length")]


def format_plan(plan: ClusterPlan) -> str:
    cfg, p, t = plan.config, plan.config.parallel, plan.config.train
    counts = count_parameters(cfg.model)
    ep_nodes = max(1, p.ep // plan.gpus_per_node)
    routing = expected_routing(cfg.model, p.ep, plan.gpus_per_node)
    schedule = plan.timeline.schedule
    lines = [
        f"cluster: {plan.nodes} node(s) x {plan.gpus_per_node} GPU(s) = {plan.world} ranks",
        f"layout: pp {p.pp} x dp {plan.dp}; ep {p.ep} ({ep_nodes} node(s) per EP group), expert-dp {plan.dp // p.ep}; "
        f"ZeRO-1 {'on' if p.zero1 else 'off'}",
        f"batch: {t.global_batch_size} x {t.seq_length} tokens per step = {plan.microbatches} micro-batches of "
        f"{t.micro_batch_size} per pipeline; precision {t.precision}"
        + (" (weights include the FP8 copy of each weight its GEMMs take, made once per step)"
           if t.precision == "fp8" else ""),
        *_ramp_lines(cfg, plan.dp),
        f"model: {counts.total_with_mtp / 1e9:.1f} B parameters ({counts.total / 1e9:.1f} B + MTP "
        f"{counts.mtp_total / 1e9:.1f} B); {len(plan.stages)} stages: "
        + ", ".join(f"{s.index}:{_stage_label(s)}" for s in plan.stages),
        f"schedule: {schedule.name}, {schedule.num_stages} stages on {schedule.num_ranks} ranks; simulated bubble "
        f"{plan.timeline.bubble:g} of {plan.timeline.makespan:g} stage-times = {100 * plan.bubble_fraction:.1f}% "
        f"(F = B = W per stage)",
        f"activations: {_recompute_label(plan.recompute)}",
        "",
        "GiB per GPU: weights (the model's parameters), main (fp32 main parameters beside them), grads, "
        "moments (Adam state), activations (at the simulated peak), buffers (the dispatcher's)",
        f"{'pp':>3} {'stages':>7} {'params':>9} {'experts':>9} {'weights':>8} {'main':>6} {'grads':>6} "
        f"{'moments':>8} {'activations':>12} {'peak mb':>8} {'buffers':>8} {'total':>7}",
    ]
    for r in plan.ranks:
        lines.append(f"{r.pp_rank:>3} {','.join(map(str, r.stages)):>7} {r.params / 1e9:>8.2f}B "
                     f"{r.expert_params / 1e9:>8.2f}B {r.weights / GIB:>8.1f} {r.main_params / GIB:>6.1f} "
                     f"{r.grads / GIB:>6.1f} {r.optimizer / GIB:>8.1f} {r.activations / GIB:>12.1f} "
                     f"{r.peak_units:>8g} {r.buffers / GIB:>8.1f} {r.total / GIB:>7.1f}")
    busiest = max(plan.ranks, key=lambda r: r.inter_node[0])
    lines += [
        "",
        f"dispatch per token and MoE layer: {routing.remote_nodes:.2f} remote nodes, {routing.intra_rows:.2f} "
        f"intra-node copies (top-{cfg.model.moe_router_topk}, {cfg.model.moe_router_group_topk} of "
        f"{cfg.model.moe_router_num_groups} groups, hidden {cfg.model.hidden_size})",
        f"dispatch + combine per step, forward + backward, busiest rank (pp {busiest.pp_rank}): "
        f"inter-node {busiest.inter_node[0] / GIB:.1f} GiB, intra-node {busiest.intra_node[0] / GIB:.1f} GiB "
        f"(BF16 dispatch); {busiest.inter_node[1] / GIB:.1f} / {busiest.intra_node[1] / GIB:.1f} GiB (FP8 dispatch)",
    ]
    return "\n".join(lines)


def _ramp_lines(config: Config, dp: int) -> list[str]:
    """The batch ramp's line of the plan (none without a ramp)."""
    ramp = batch_ramp(config.train)
    if not ramp.samples:
        return []
    per_pipeline = config.train.micro_batch_size * dp
    return [f"batch ramp: {ramp.describe()}: {ramp.start // per_pipeline} to {ramp.final // per_pipeline} "
            f"micro-batches per pipeline, by {ramp.increment // per_pipeline}; activations at the largest peak of "
            "every step's schedule"]


def _recompute_label(modules: tuple[str, ...]) -> str:
    if FULL_RECOMPUTE in modules:
        return "every decoder layer recomputed in backward"
    if modules:
        return f"selective recompute in backward: {', '.join(modules)}"
    return "no recomputation"


def _stage_label(stage: Stage) -> str:
    parts = ["E"] * stage.embedding
    if stage.layers:
        parts.append(f"L{stage.layers.start}-{stage.layers.stop - 1}")
    if stage.head:
        parts.append("head+MTP")
    return "+".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_train.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, required=True)
    parser.add_argument("--gpu-memory-gib", type=float, default=None, help="fail if a rank needs more")
    parser.add_argument("--reserve-gib", type=float, default=4.0,
                        help="per GPU, for the CUDA context, communication buffers and fragmentation (default 4)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        plan = make_plan(config, args.nodes, args.gpus_per_node)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    if args.gpu_memory_gib is None:
        return 0
    problems = fit_problems(plan, args.gpu_memory_gib, args.reserve_gib)
    if problems:
        print(f"error: {ConfigError(problems, args.config)}", file=sys.stderr)
        return 2
    need = max(r.total for r in plan.ranks) / GIB + args.reserve_gib
    print(f"fits: at most {need:.1f} GiB per GPU (including {args.reserve_gib:g} GiB reserve) of {args.gpu_memory_gib:g} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
