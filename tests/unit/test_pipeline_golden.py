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
