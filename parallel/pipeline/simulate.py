"""Command line: build, validate and simulate a schedule; print its bubble and memory.

    python -m parallel.pipeline.simulate --schedule NAME --ranks R --microbatches M
        [--virtual-stages V] [--cost-f F --cost-b B --cost-w W --cost-fb X --comm C]
        [--mem-b FRACTION] [--json] [--plot out.png]

Costs are per stage (one model chunk, one micro-batch); --cost-fb is one overlapped FB action
(default: F + B + W). Peak activations are in units of one stage's activations of one
micro-batch.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from .builders import SCHEDULES, build
from .timeline import Costs, Timeline, simulate
from .validate import validate


def summary(timeline: Timeline) -> dict:
    """The numbers the CLI reports, as plain JSON-able values."""
    schedule, costs = timeline.schedule, timeline.costs

    def clean(values: Sequence[float]) -> list[float]:
        return [_round(v) for v in values]

    return {
        "schedule": schedule.name,
        "ranks": schedule.num_ranks,
        "stages": schedule.num_stages,
        "microbatches": schedule.num_microbatches,
        "costs": {
            "f": costs.f, "b": costs.b, "w": costs.w, "fb": costs.fb,
            "comm": costs.comm, "mem_b": costs.mem_b,
        },
        "makespan": _round(timeline.makespan),
        "bubble": _round(timeline.bubble),
        "busy": clean(timeline.busy),
        "span_bubble": clean(timeline.span_bubble),
        "peak_activations": clean(timeline.peak_activations),
    }


def _round(value: float) -> float:
    return round(value, 9) + 0.0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m parallel.pipeline.simulate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--schedule", required=True, choices=SCHEDULES)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--virtual-stages", type=int, default=None,
                        help="stages per rank (default: the schedule's own)")
    parser.add_argument("--cost-f", type=float, default=1.0)
    parser.add_argument("--cost-b", type=float, default=1.0, help="input-grad backward")
    parser.add_argument("--cost-w", type=float, default=1.0, help="weight-grad backward")
    parser.add_argument("--cost-fb", type=float, default=None, help="one overlapped FB action")
    parser.add_argument("--comm", type=float, default=0.0, help="latency of a cross-rank edge")
    parser.add_argument("--mem-b", type=float, default=0.0,
                        help="fraction of a micro-batch's activations freed by B (rest by W)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--plot", metavar="PNG", help="draw the per-rank timeline")
    args = parser.parse_args(argv)
    try:
        costs = Costs(args.cost_f, args.cost_b, args.cost_w, args.cost_fb, args.comm, args.mem_b)
        schedule = build(args.schedule, args.ranks, args.microbatches, args.virtual_stages, costs)
    except ValueError as err:
        parser.error(str(err))
    validate(schedule, costs)
    timeline = simulate(schedule, costs)
    report = summary(timeline)
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(report)
    if args.plot:
        from .plot import plot_timeline

        plot_timeline(timeline, args.plot)
    return 0


def _print_table(report: dict) -> None:
    print(
        f"{report['schedule']}: {report['ranks']} ranks, {report['stages']} stages, "
        f"{report['microbatches']} micro-batches"
    )
    print(f"makespan {report['makespan']:g}  bubble {report['bubble']:g}")
    print("rank  busy  span_bubble  peak_activations")
    for rank, (busy, span, peak) in enumerate(
        zip(report["busy"], report["span_bubble"], report["peak_activations"])
    ):
        print(f"{rank:4d}  {busy:4g}  {span:11g}  {peak:16g}")


if __name__ == "__main__":
    sys.exit(main())
