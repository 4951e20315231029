"""The straggler report's arithmetic (moe_train.straggler) on given figures: who is named against which
median, per pipeline stage, and the compute clock that leaves out the waits of the MoE all-to-alls. The
processes are in tests/distributed/test_straggler.py. No random inputs are drawn."""
import time

from moe_train.straggler import ComputeClock, RankTimes, find_stragglers, rank_metrics, straggler_line
from parallel.dispatch.handles import OverlapSwitch


def times(*compute_s: float, stages: tuple[int, ...] | None = None) -> list[RankTimes]:
    stages = stages or (0,) * len(compute_s)
    return [RankTimes(rank, f"node{rank // 2}", stage, 2.0, c)
            for rank, (c, stage) in enumerate(zip(compute_s, stages))]


def named(found) -> list[int]:
    return [s.times.rank for s in found]


def test_the_slowest_rank_is_named_against_the_median_not_the_mean():
    # median 1.05, mean 1.1: 1.3 is more than 20% above the median, not above the mean
    found = find_stragglers(times(1.0, 1.0, 1.1, 1.3), 0.2)
    assert named(found) == [3] and found[0].median_s == 1.05 and found[0].ranks == 4
    assert named(find_stragglers(times(1.0, 1.0, 1.1, 1.26), 0.2)) == []  # 1.26 = 1.2 x 1.05: not more
    assert named(find_stragglers(times(1.0, 1.0, 1.1, 1.3), 0.25)) == []  # a higher threshold


def test_each_pipeline_stage_is_compared_with_its_own_ranks():
    stages = (0, 0, 1, 1, 1)
    assert named(find_stragglers(times(1.0, 1.0, 3.0, 3.0, 3.0, stages=stages), 0.2)) == []  # stages differ by design
    assert named(find_stragglers(times(1.0, 2.0, 3.0, 3.0, 4.0, stages=stages), 0.2)) == [1, 4]
    assert named(find_stragglers(times(1.0, 9.0, stages=(0, 1)), 0.2)) == []  # one rank per stage: no peers
    assert named(find_stragglers(times(0.0, 0.0), 0.2)) == []


def test_the_line_names_rank_host_time_and_median():
    found = find_stragglers(times(1.0, 1.0, 1.0, 2.5), 0.2)
    assert straggler_line(found[0], 40, 0.2) == (
        "straggler at step 40: rank 3 on node1 computes 2.500 s per step, 2.50x the median 1.000 s of the 4 ranks "
        "of pipeline stage 0 (step 2.000 s; logging.straggler_threshold=0.2)")
    assert rank_metrics(times(1.0, 1.5)) == {"ranks/0/step_s": 2.0, "ranks/0/compute_s": 1.0,
                                             "ranks/1/step_s": 2.0, "ranks/1/compute_s": 1.5}


class Slept:
    """A handle whose wait takes `seconds`."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def wait(self) -> None:
        time.sleep(self.seconds)


def test_the_compute_clock_leaves_out_the_waits_through_the_switch():
    switch = OverlapSwitch()
    clock = ComputeClock(switch)
    with clock.phase():
        time.sleep(0.05)
        switch.complete(Slept(0.3))
    with clock.phase(busy_s=lambda: 0.5):  # the pipeline's compute actions, which held the wait
        switch.complete(Slept(0.2))
    switch.complete(Slept(0.1))  # outside a phase: counted nowhere
    seconds, steps = clock.take()
    # 0.05 s computed in the first phase and 0.5 - 0.2 in the second (0.85 s with the waits)
    assert steps == 2 and 0.25 < seconds < 0.45, seconds
    assert switch.waited_s >= 0.6 and clock.take() == (0.0, 0)
