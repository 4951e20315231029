"""zb-auto (issue 19, part 2): under a memory limit it is never longer than ZB-H1 or ZB-H2 at the
same limit, it stays under the limit, every schedule it emits passes every validator (deadlock
replay included), and the ``parallel.zb_*`` keys are validated at load.
"""
import math
import random

import pytest

from moe_train.config import ConfigError, load_config
from parallel.pipeline import Costs, build, validate
from parallel.pipeline.builders import build_zb_auto, build_zb_h2
from parallel.pipeline.builders.zb_auto import parse_zb_costs
from parallel.pipeline.timeline import simulate

SEED = 19


def _cost_sets() -> list[Costs]:
    """Two fixed sets and a few seeded random ones (F, B, W in [0.5, 2], comm and mem_b drawn)."""
    rng = random.Random(SEED)
    drawn = [
        Costs(
            f=round(rng.uniform(0.5, 2), 2),
            b=round(rng.uniform(0.5, 2), 2),
            w=round(rng.uniform(0.5, 2), 2),
            comm=round(rng.choice([0.0, rng.uniform(0, 0.5)]), 2),
            mem_b=rng.choice([0.0, 0.3, 0.5]),
        )
        for _ in range(4)
    ]
    print(f"zb-auto random costs drawn with seed {SEED}: {drawn}")
    return [Costs(f=1.0, b=1.2, w=0.8), Costs(comm=0.2, mem_b=0.5)] + drawn


def _limits(ranks: int) -> list[float]:
    return [float(ranks), ranks + 0.5, 2.0 * ranks - 1]


def _makespan_if_fits(schedule, costs: Costs, limit: float) -> float:
    timeline = simulate(schedule, costs)
    return timeline.makespan if max(timeline.peak_activations) <= limit + 1e-9 else math.inf


@pytest.mark.parametrize("costs", _cost_sets(), ids=lambda c: f"{c.f}/{c.b}/{c.w}/c{c.comm}/m{c.mem_b}")
def test_zb_auto_is_never_worse_than_zb_h1_or_zb_h2_and_passes_the_validators(costs):
    for ranks, microbatches in [(2, 4), (3, 7), (4, 8), (4, 12), (6, 18), (8, 16)]:
        for limit in _limits(ranks):
            schedule = build_zb_auto(ranks, microbatches, None, costs, limit)
            validate(schedule, costs)
            timeline = simulate(schedule, costs)
            assert max(timeline.peak_activations) <= limit + 1e-9
            zb_h1 = _makespan_if_fits(build("zb-h1", ranks, microbatches, None, costs), costs, limit)
            zb_h2 = simulate(build_zb_h2(ranks, microbatches, None, costs, int(limit)), costs)
            best = min(zb_h1, zb_h2.makespan)
            assert timeline.makespan <= best + 1e-9, (ranks, microbatches, limit)


def test_zb_auto_spends_the_memory_that_b_frees():
    """B freeing half a micro-batch lets more forwards in flight under the same 2p-1 limit: p=8,
    m=24, F/B/W = 1/1.5/0.5 reaches the bound (p-1)F + m(F+B+W) = 79, ZB-H2 (counting whole
    micro-batches until W) needs 82.5 and ZB-H1 86."""
    costs = Costs(f=1.0, b=1.5, w=0.5, mem_b=0.5)
    auto = simulate(build("zb-auto", 8, 24, None, costs), costs)
    assert auto.makespan == pytest.approx(79.0)
    assert simulate(build("zb-h2", 8, 24, None, costs), costs).makespan == pytest.approx(82.5)
    assert max(auto.peak_activations) <= 15.0


def test_zb_auto_default_limit_is_2p_minus_1():
    costs = Costs(f=1.0, b=1.2, w=0.8)
    default = build("zb-auto", 4, 8, None, costs)
    assert default.programs == build_zb_auto(4, 8, None, costs, 7.0).programs
    assert max(simulate(default, costs).peak_activations) == 7.0


def test_zb_auto_rejects_a_limit_below_one_forward():
    with pytest.raises(ValueError, match="^memory_limit"):
        build_zb_auto(4, 8, memory_limit=0.5)


def test_zb_costs_text():
    assert parse_zb_costs("1, 1.2, 0.8, 0.1") == Costs(f=1.0, b=1.2, w=0.8, comm=0.1)
    assert parse_zb_costs("2,1,1") == Costs(f=2.0, b=1.0, w=1.0)
    for bad in ("1,2", "1,x,1", "1,0,1", "1,1,1,-1", "1,nan,1"):
        with pytest.raises(ValueError, match="^zb_costs"):
            parse_zb_costs(bad)


@pytest.mark.parametrize("override, key, fragment", [
    ("parallel.zb_memory_limit=0.5", "parallel.zb_memory_limit", ">= 1"),
    ("parallel.zb_costs=1,2", "parallel.zb_costs", "f,b,w"),
    ("parallel.zb_costs=1,0,1", "parallel.zb_costs", "must be > 0"),
])
def test_config_rejects_bad_zb_keys(override, key, fragment):
    with pytest.raises(ConfigError) as err:
        load_config("moe_train/configs/tiny.yaml", [override])
    assert any(k == key and fragment in m for k, m in err.value.problems), err.value.problems


def test_config_accepts_zb_auto():
    config = load_config(
        "moe_train/configs/tiny.yaml",
        ["parallel.schedule=zb-auto", "parallel.zb_memory_limit=3", "parallel.zb_costs=1,1.2,0.8,0.1"],
    )
    assert (config.parallel.zb_memory_limit, config.parallel.zb_costs) == (3.0, "1,1.2,0.8,0.1")


def test_the_trainer_and_the_planner_build_zb_auto_from_the_config():
    from moe_train.preflight.plan import _schedule
    from moe_train.preflight.pipeline import plan_pipeline

    sets = ["parallel.pp=2", "parallel.schedule=zb-auto", "parallel.zb_costs=1,1.5,0.5,0.1",
            "parallel.zb_memory_limit=2.5", "train.global_batch_size=8", "train.micro_batch_size=1"]
    config = load_config("moe_train/configs/tiny.yaml", sets)
    want = build_zb_auto(2, 8, None, Costs(f=1, b=1.5, w=0.5, comm=0.1), 2.5)
    lowered, _ = plan_pipeline(config, dp=1)
    assert lowered.schedule.programs == want.programs
    assert _schedule(config, dp=1).programs == want.programs
    default = build_zb_auto(2, 8)
    assert default.programs != want.programs  # the settings changed the search
    with pytest.raises(ConfigError, match="applies to parallel.schedule=zb-auto only"):
        load_config("moe_train/configs/tiny.yaml", ["parallel.pp=2", "parallel.schedule=zb-h1",
                                                    "parallel.zb_memory_limit=3"])
