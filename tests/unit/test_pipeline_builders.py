"""Every builder over a grid of sizes passes every validator; requirements are enforced."""
from collections import Counter

import pytest

from parallel.pipeline import SCHEDULES, ActionKind, CommBatch, Costs, build, validate

UNEVEN = Costs(f=1.0, b=1.2, w=0.8, fb=2.5, comm=0.3)

GRID = {
    "1f1b": [(r, m, None) for r in (1, 2, 3, 4, 8) for m in (1, 2, 5, 8, 16)],
    "combined-1f1b": [(r, m, None) for r in (1, 2, 3, 4, 8) for m in (1, 2, 5, 8, 16, 17)],
    "interleaved-1f1b": [(r, k * r, v) for r in (1, 2, 3, 4) for k in (1, 2, 4) for v in (2, 3)],
    "zb-h1": [(r, m, None) for r in (1, 2, 3, 4, 8) for m in (1, 2, 5, 8, 16)],
    "zb-h2": [(r, m, None) for r in (1, 2, 3, 4, 8) for m in (1, 2, 5, 8, 16)],
    "zb-auto": [(r, m, None) for r in (1, 2, 3, 4, 8) for m in (1, 2, 5, 8, 16)],
    "zb-interleaved": [(r, m, v) for r in (1, 2, 3, 4) for m in (1, r + 1, 2 * r, 4 * r) for v in (2, 3)],
    "zbv": [(r, m, 2) for r in (1, 2, 3, 4, 8) for m in (2 * r - 1, 2 * r, 3 * r + 1)],
    "dualpipe": [(r, m, None) for r in (2, 4, 6, 8) for m in (2 * r, 2 * r + 2, 4 * r)],
    "dualpipev": [(r, m, 2) for r in (1, 2, 3, 4, 8) for m in (2 * r, 2 * r + 1, 4 * r)],
}


def test_grid_covers_every_shipped_schedule():
    assert set(GRID) == set(SCHEDULES)


@pytest.mark.parametrize("name", sorted(GRID))
@pytest.mark.parametrize("costs", [None, UNEVEN], ids=["unit", "uneven"])
def test_every_builder_passes_all_validators(name, costs):
    for ranks, microbatches, virtual in GRID[name]:
        schedule = build(name, ranks, microbatches, virtual, costs)
        validate(schedule, costs)
        assert schedule.num_ranks == ranks
        assert schedule.num_microbatches == microbatches


@pytest.mark.parametrize(
    "name, ranks, microbatches, virtual, param",
    [
        ("1f1b", 0, 4, None, "ranks"),
        ("1f1b", 2, 0, None, "microbatches"),
        ("1f1b", 2, 4, 2, "virtual_stages"),
        ("combined-1f1b", 0, 4, None, "ranks"),
        ("combined-1f1b", 2, 0, None, "microbatches"),
        ("combined-1f1b", 2, 4, 2, "virtual_stages"),
        ("interleaved-1f1b", 4, 6, 2, "microbatches"),
        ("interleaved-1f1b", 4, 8, 1, "virtual_stages"),
        ("zb-h1", 4, 8, 3, "virtual_stages"),
        ("zb-h2", 0, 8, None, "ranks"),
        ("zbv", 4, 6, None, "microbatches"),
        ("zbv", 4, 8, 1, "virtual_stages"),
        ("dualpipe", 3, 12, None, "ranks"),
        ("dualpipe", 4, 6, None, "microbatches"),
        ("dualpipe", 4, 9, None, "microbatches"),
        ("dualpipev", 4, 7, None, "microbatches"),
        ("dualpipev", 4, 8, 3, "virtual_stages"),
        ("gpipe", 4, 8, None, "schedule"),
    ],
)
def test_violated_requirements_name_the_parameter(name, ranks, microbatches, virtual, param):
    with pytest.raises(ValueError, match=rf"^{param}:"):
        build(name, ranks, microbatches, virtual)


def test_zb_h2_rejects_a_nonpositive_memory_cap():
    from parallel.pipeline.builders.zero_bubble import build_zb_h2

    with pytest.raises(ValueError, match="^max_inflight:"):
        build_zb_h2(4, 8, max_inflight=0)


def _kinds(program):
    return Counter(a.kind for a in program)


@pytest.mark.parametrize("name, ranks, microbatches", [("dualpipe", 8, 20), ("dualpipev", 4, 11)])
def test_dualpipe_programs_follow_the_eight_phases(name, ranks, microbatches):
    """Counts implied by the 8 phases for depth h of H and n micro-batches per phase.

    FB: 2 per main-loop round (n-2H+h+1 rounds, the deepest rank's first pair unfused) plus
    H-h-1 in phase 5. Split backwards: H-h-1 (phase 3) + h+1 (phase 6) + H-h-1 (phase 7).
    Every rank runs 2H forwards before its first backward, the deepest rank one more (its first
    main-loop F0 runs unfused).
    """
    schedule = build(name, ranks, microbatches)
    depths = ranks // 2 if name == "dualpipe" else ranks
    per_phase = microbatches // 2 if name == "dualpipe" else microbatches
    for rank, program in enumerate(schedule.programs):
        h = min(rank, ranks - 1 - rank) if name == "dualpipe" else rank
        rounds = per_phase - 2 * depths + h + 1
        kinds = _kinds(program)
        assert kinds[ActionKind.FB] == 2 * rounds - (h == depths - 1) + (depths - h - 1)
        assert kinds[ActionKind.B] == kinds[ActionKind.W] == 2 * (depths - h - 1) + h + 1
        first_backward = next(i for i, a in enumerate(program) if a.kind is not ActionKind.F)
        assert first_backward == 2 * depths + (h == depths - 1)


@pytest.mark.parametrize("ranks, microbatches", [(1, 4), (4, 3), (4, 12), (8, 20)])
def test_combined_1f1b_pairs_every_steady_state_forward_with_an_older_backward(ranks, microbatches):
    """Rank r: 2(R-1-r)+1 warm-up F, then FB(F m+warm-up, BW m), then the remaining BW."""
    schedule = build("combined-1f1b", ranks, microbatches)
    for rank, program in enumerate(schedule.programs):
        warmup = min(2 * (ranks - 1 - rank) + 1, microbatches)
        pairs = [a for a in program if a.kind is ActionKind.FB]
        assert [a.kind for a in program] == (
            [ActionKind.F] * warmup + [ActionKind.FB] * len(pairs) + [ActionKind.BW] * warmup
        )
        assert [(a.microbatch, a.b_kind, a.b_microbatch) for a in pairs] == [
            (m + warmup, ActionKind.BW, m) for m in range(microbatches - warmup)
        ]
        assert all(a.stage == a.b_stage == rank for a in pairs)


def test_dualpipe_mirror_ranks_run_the_same_program_with_directions_swapped():
    ranks, microbatches = 6, 16
    schedule = build("dualpipe", ranks, microbatches)
    half = microbatches // 2

    def mirrored(action):
        halves = action.halves()
        return tuple((h.kind, h.stage, (h.microbatch + half) % microbatches) for h in halves)

    def plain(action):
        return tuple((h.kind, h.stage, h.microbatch) for h in action.halves())

    for rank in range(ranks):
        mine = [plain(a) for a in schedule.programs[rank]]
        other = [mirrored(a) for a in schedule.programs[ranks - 1 - rank]]
        assert mine == other


def test_zbv_warms_up_with_2_ranks_minus_1_chunk0_forwards_then_a_chunk1_forward():
    ranks = 4
    schedule = build("zbv", ranks, 8)
    for rank, program in enumerate(schedule.programs):
        warmup = 2 * (ranks - rank) - 1
        assert [(a.kind, a.stage) for a in program[:warmup]] == [(ActionKind.F, rank)] * warmup
        assert (program[warmup].kind, program[warmup].stage) == (ActionKind.F, 2 * ranks - 1 - rank)


def test_interleaved_walks_chunks_in_groups_of_ranks():
    ranks, chunks, microbatches = 2, 2, 4
    schedule = build("interleaved-1f1b", ranks, microbatches, chunks)
    forwards = [(a.stage, a.microbatch) for a in schedule.programs[0] if a.kind is ActionKind.F]
    assert forwards == [(0, 0), (0, 1), (2, 0), (2, 1), (0, 2), (0, 3), (2, 2), (2, 3)]


def test_plan_returns_lowered_programs_with_batched_communication():
    lowered = validate(build("1f1b", 3, 4))
    assert lowered.schedule.name == "1f1b"
    middle = lowered.programs[1]
    batches = [s for s in middle if isinstance(s, CommBatch)]
    assert batches and all(op.is_comm for b in batches for op in b.ops)
    computes = [s for s in middle if not isinstance(s, CommBatch)]
    assert tuple(computes) == lowered.schedule.programs[1]
    assert sum(len(b.ops) for b in batches) == 4 * 4
