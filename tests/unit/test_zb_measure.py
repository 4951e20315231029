"""zb-auto's measured costs: the warm-up's first step is dropped, the rest averaged per action kind, in
units of F; which configurations measure."""
import pytest

from moe_train.config import ParallelConfig
from moe_train.zb_measure import ZbCostMeter, measures_zb_costs
from parallel.pipeline import ActionKind


class Timed:
    def __init__(self, f, b, w):
        self.action_s = {ActionKind.F: f, ActionKind.B: b, ActionKind.W: w}


def test_the_first_step_is_dropped_and_the_rest_averaged_in_units_of_f():
    meter = ZbCostMeter(3)
    meter.record(Timed([9.0, 9.0], [9.0], [9.0]))  # first step: allocations, not counted
    assert not meter.done
    meter.record(Timed([0.010, 0.014], [0.024], [0.006]))
    meter.record(Timed([0.012], [0.018, 0.018], [0.006, 0.006]))
    assert meter.done
    measured = meter.measured("cpu")
    assert measured.seconds == pytest.approx((0.012, 0.020, 0.006))
    costs = measured.costs
    assert (costs.f, costs.b, costs.w, costs.comm) == pytest.approx((1.0, 20 / 12, 0.5, 0.0))


def test_which_configs_measure():
    assert measures_zb_costs(ParallelConfig(pp=2, schedule="zb-auto"))
    assert not measures_zb_costs(ParallelConfig(pp=2, schedule="zb-auto", zb_costs="1,1,1"))
    assert not measures_zb_costs(ParallelConfig(pp=2, schedule="zb-h1"))
    assert not measures_zb_costs(ParallelConfig(pp=1, schedule="zb-auto"))
    with pytest.raises(ValueError, match="at least 2 steps"):
        ZbCostMeter(1)
