"""Simulated bubble and activation memory against the published formulas and the reference
brief's golden table (section 7.6): communication 0, bubble = max over ranks of makespan - busy.
"""
import pytest

from parallel.pipeline import Costs, build
from parallel.pipeline.timeline import simulate

UNIT = Costs()
COST_SETS = [UNIT, Costs(f=1.0, b=1.5, w=0.5), Costs(f=2.0, b=1.0, w=1.0)]


def _run(name, ranks, microbatches, costs=UNIT, virtual=None):
    return simulate(build(name, ranks, microbatches, virtual, costs), costs)


@pytest.mark.parametrize("costs", COST_SETS)
@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
def test_1f1b_bubble_and_memory(ranks, costs):
    for microbatches in (ranks, 3 * ranks + 1):
        timeline = _run("1f1b", ranks, microbatches, costs)
        assert timeline.bubble == pytest.approx((ranks - 1) * (costs.f + costs.b + costs.w))
        assert timeline.peak_activations == tuple(float(ranks - r) for r in range(ranks))


@pytest.mark.parametrize("ranks, microbatches, bubble", [(4, 12, 9.0), (8, 24, 21.0)])
def test_1f1b_brief_values(ranks, microbatches, bubble):
    assert _run("1f1b", ranks, microbatches).bubble == pytest.approx(bubble)


@pytest.mark.parametrize("gain", [0.0, 0.2, 1.0], ids=["fb=f+b+w", "fb-20%", "fb=max(f,b+w)"])
@pytest.mark.parametrize("costs", COST_SETS)
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_combined_1f1b_bubble_makespan_and_memory(ranks, costs, gain):
    """The fill and drain sit in unpaired F's and BW's, so the bubble stays 1F1B's
    (p-1)(F+B+W); every one of the last rank's M-1 pairs shortens the step by F+B+W-F&B.
    Activations in flight double (2(p-r)) for the deeper warm-up. F&B runs from F+B+W (no
    overlap gain) down to max(F, B+W) (the shorter half entirely hidden), ``gain`` of the way."""
    full = costs.f + costs.b + costs.w
    pair = full - gain * (full - max(costs.f, costs.b + costs.w))
    costs = Costs(costs.f, costs.b, costs.w, None if gain == 0 else pair)
    for microbatches in (2 * ranks, 3 * ranks + 1):
        timeline = _run("combined-1f1b", ranks, microbatches, costs)
        assert timeline.bubble == pytest.approx((ranks - 1) * full)
        makespan = (ranks - 1) * full + full + (microbatches - 1) * pair
        assert timeline.makespan == pytest.approx(makespan)
        assert timeline.peak_activations == tuple(2.0 * (ranks - r) for r in range(ranks))


@pytest.mark.parametrize("fb, makespan", [(None, 33.0), (3.0, 33.0), (2.4, 28.8), (2.0, 26.0)])
def test_combined_1f1b_brief_values(fb, makespan):
    """4 ranks, 8 micro-batches: 1F1B's 33 and bubble 9 at F&B = F+B+W, shorter steps below it."""
    timeline = _run("combined-1f1b", 4, 8, Costs(fb=fb))
    assert (timeline.makespan, timeline.bubble) == pytest.approx((makespan, 9.0))
    assert timeline.makespan == pytest.approx(_run("1f1b", 4, 8).makespan - 7 * (3.0 - (fb or 3.0)))
    assert timeline.span_bubble[-1] == pytest.approx(0.0)


@pytest.mark.parametrize("costs", COST_SETS)
@pytest.mark.parametrize("ranks, chunks", [(2, 2), (4, 2), (4, 3), (3, 4)])
def test_interleaved_bubble_is_1f1b_bubble_of_one_chunk(ranks, chunks, costs):
    """Megatron's (p-1)(F+B+W)/v in full-stage time, i.e. (p-1)(F+B+W) with per-chunk costs."""
    timeline = _run("interleaved-1f1b", ranks, 2 * ranks, costs, chunks)
    assert timeline.bubble == pytest.approx((ranks - 1) * (costs.f + costs.b + costs.w))


@pytest.mark.parametrize("costs", COST_SETS)
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_zb_h1_bubble_is_p_minus_1_times_f_plus_b_minus_w(ranks, costs):
    for microbatches in (ranks, 3 * ranks):
        timeline = _run("zb-h1", ranks, microbatches, costs)
        assert timeline.bubble == pytest.approx((ranks - 1) * (costs.f + costs.b - costs.w))


@pytest.mark.parametrize(
    "ranks, microbatches, costs, bubble",
    [(4, 12, UNIT, 3.0), (8, 24, UNIT, 7.0), (8, 24, Costs(f=1.0, b=1.2, w=0.8), 9.8)],
)
def test_zb_h1_brief_values(ranks, microbatches, costs, bubble):
    assert _run("zb-h1", ranks, microbatches, costs).bubble == pytest.approx(bubble)


def test_zb_h1_keeps_1f1b_memory():
    """In flight (until W) every stage holds p micro-batches; counted until B, it is 1F1B's p..1."""
    ranks = 6
    schedule = build("zb-h1", ranks, 18)
    assert simulate(schedule).peak_activations == (float(ranks),) * ranks
    freed_by_b = simulate(schedule, Costs(mem_b=1.0)).peak_activations
    assert freed_by_b == tuple(float(ranks - r) for r in range(ranks))


@pytest.mark.parametrize("ranks, microbatches", [(4, 12), (8, 24)])
def test_zb_h2_has_no_bubble_inside_any_rank_span(ranks, microbatches):
    timeline = _run("zb-h2", ranks, microbatches)
    assert timeline.span_bubble == pytest.approx((0.0,) * ranks)
    assert timeline.bubble == pytest.approx((ranks - 1) * UNIT.f)
    assert timeline.peak_activations[0] == 2 * ranks - 1


@pytest.mark.parametrize("ranks, microbatches", [(4, 8), (4, 16), (8, 16), (8, 32)])
def test_zbv_brief_values(ranks, microbatches):
    timeline = _run("zbv", ranks, microbatches)
    assert timeline.span_bubble == pytest.approx((0.0,) * ranks)
    assert timeline.bubble == pytest.approx(ranks - 1)
    assert timeline.peak_activations == (2.0 * ranks,) * ranks


def _dualpipe_formula(depths, costs):
    full_backward = costs.b + costs.w
    return (depths - 1) * (costs.fb + full_backward - 3 * costs.w)


@pytest.mark.parametrize("fb", [3.0, 2.4])
@pytest.mark.parametrize("ranks", [4, 8])
def test_dualpipe_bubble_formula_and_independence_from_microbatches(ranks, fb):
    costs = Costs(fb=fb)
    expected = _dualpipe_formula(ranks // 2, costs)
    for microbatches in range(2 * ranks, 41, 4):
        timeline = _run("dualpipe", ranks, microbatches, costs)
        assert timeline.bubble == pytest.approx(expected)
        assert timeline.peak_activations == (ranks + 1.0,) * ranks


@pytest.mark.parametrize(
    "ranks, fb, bubble", [(4, 3.0, 2.0), (4, 2.4, 1.4), (8, 3.0, 6.0), (8, 2.4, 4.2)]
)
def test_dualpipe_brief_values(ranks, fb, bubble):
    for microbatches in (2 * ranks, 40):
        assert _run("dualpipe", ranks, microbatches, Costs(fb=fb)).bubble == pytest.approx(bubble)


@pytest.mark.parametrize("fb", [3.0, 2.4])
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_dualpipev_bubble_formula_with_r_ranks_holding_2r_stages(ranks, fb):
    costs = Costs(fb=fb)
    expected = _dualpipe_formula(ranks, costs)
    for microbatches in (2 * ranks, 2 * ranks + 3, 5 * ranks):
        timeline = _run("dualpipev", ranks, microbatches, costs)
        assert timeline.bubble == pytest.approx(expected)
        assert timeline.peak_activations == (2 * ranks + 1.0,) * ranks


@pytest.mark.parametrize(
    "ranks, microbatches, costs, bubble",
    [
        (4, 10, Costs(fb=3.0), 6.0),
        (4, 20, Costs(fb=3.0), 6.0),
        (4, 10, Costs(fb=2.4), 4.2),
        (4, 20, Costs(fb=2.4), 4.2),
        (8, 20, Costs(fb=3.0), 14.0),
        (8, 40, Costs(fb=3.0), 14.0),
        (8, 20, Costs(fb=2.4), 9.8),
        (8, 40, Costs(fb=2.4), 9.8),
        (4, 10, Costs(f=1.0, b=1.2, w=0.8, fb=2.5), 5.7),
        (8, 20, Costs(f=1.0, b=1.2, w=0.8, fb=2.5), 13.7),
    ],
)
def test_dualpipev_brief_values(ranks, microbatches, costs, bubble):
    assert _run("dualpipev", ranks, microbatches, costs).bubble == pytest.approx(bubble)


def test_default_fb_cost_is_f_plus_full_backward():
    """Without an overlap gain, DualPipe's bubble is the formula with F&B = F + B + W."""
    costs = Costs(f=1.0, b=1.2, w=0.8)
    timeline = _run("dualpipe", 4, 8, costs)
    explicit = _run("dualpipe", 4, 8, Costs(f=1.0, b=1.2, w=0.8, fb=3.0))
    assert timeline.bubble == pytest.approx(explicit.bubble)
