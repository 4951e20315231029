"""The batch ramp (train.rampup_batch_size, moe_train.batch_ramp): its batch sequence and the schedules
that follow consumed samples against Megatron's formula written out here, the refusals of ramps a run
cannot take (exit 2, one line naming the key), the planner's memory over every step's schedule, and the
671B recipe's ramp. The random ramps print their seed."""
import math
import random
from fractions import Fraction

import pytest

from moe_train.batch_ramp import BatchRamp, batch_ramp
from moe_train.config import OptimConfig, load_config
from moe_train.preflight import launch_info, plan
from moe_train.schedules import bias_update_rate, learning_rate, mtp_loss_scale
from moe_train.train import main
from parallel.pipeline.builders import build
from parallel.pipeline.timeline import simulate
from tests.unit.test_train import ROOT, TINY

DSV3 = str(ROOT / "moe_train/configs/dsv3_671b.yaml")


@pytest.fixture
def rng():
    seed = random.SystemRandom().randrange(2**32)
    print(f"rng seed {seed}")
    return random.Random(seed)


def megatron_batch(consumed: int, start: int, increment: int, samples: int, final: int) -> int:
    """Megatron's ramp, from its definition: (final - start) / increment increments spread evenly over
    `samples` samples; past them the final batch (exact arithmetic where Megatron uses floats)."""
    if consumed > samples:
        return final
    per_increment = Fraction(samples, (final - start) // increment)
    return start + math.floor(consumed / per_increment) * increment


def random_ramp(rng: random.Random) -> tuple[BatchRamp, int]:
    """A valid ramp over micro-batches of `unit` samples (micro batch x dp), and `unit`."""
    unit = rng.choice([1, 2, 3, 4, 8])
    start = unit * rng.randint(1, 6)
    increment = unit * rng.randint(1, 4)
    final = start + increment * rng.randint(1, 8)
    return BatchRamp(final, start, increment, rng.randint(1, 40 * final)), unit


def test_batch_sequence_follows_megatrons_formula_of_consumed_samples(rng):
    for _ in range(200):
        ramp, unit = random_ramp(rng)
        consumed, seen = 0, []
        while consumed <= ramp.samples + 2 * ramp.final:
            size = ramp.batch_size(consumed)
            assert size == megatron_batch(consumed, ramp.start, ramp.increment, ramp.samples, ramp.final), \
                (ramp, consumed)
            seen.append(size)
            consumed += size
        assert seen == sorted(seen) and seen[-1] == ramp.final and all(s % unit == 0 for s in seen)
        assert set(seen) <= set(ramp.sizes()) and ramp.sizes() == list(range(ramp.start, ramp.final + 1,
                                                                                ramp.increment))
        end = rng.randint(0, consumed)
        steps, reached = 0, 0
        while reached + megatron_batch(reached, ramp.start, ramp.increment, ramp.samples, ramp.final) <= end:
            reached += megatron_batch(reached, ramp.start, ramp.increment, ramp.samples, ramp.final)
            steps += 1
        assert ramp.walk(0, end) == (steps, reached), (ramp, end)


def test_no_ramp_is_the_final_batch_at_every_step():
    ramp = batch_ramp(load_config(TINY).train)
    assert ramp.sizes() == [8] and {ramp.batch_size(c) for c in (0, 1, 8, 10**9)} == {8}
    assert ramp.walk(0, 20 * 8) == (20, 160) and ramp.describe() == ""


def test_schedules_follow_consumed_samples(rng):
    """Warm-up and cosine of the learning rate written in samples: warm-up reaches lr x (samples consumed by
    the end of the step) / (warm-up samples), the cosine runs over the samples after it; the MTP weight and
    the bias rate switch at the first step that starts at or after their switch step's samples."""
    ramp, _ = random_ramp(rng)
    final = ramp.final
    warmup, total = rng.randint(1, 5), rng.randint(8, 30)
    o = OptimConfig(lr=1.0, min_lr=0.1, lr_warmup_steps=warmup, lr_schedule="cosine",
                    mtp_loss_switch_step=rng.randint(1, total), mtp_loss_scale_final=0.1,
                    bias_update_switch_step=rng.randint(1, total), bias_update_rate_final=0.0)
    model = load_config(TINY).model
    consumed = 0
    while consumed + ramp.batch_size(consumed) <= total * final:
        size = ramp.batch_size(consumed)
        if consumed < warmup * final:
            expected = min(consumed + size, warmup * final) / (warmup * final)
        else:
            progress = (consumed - warmup * final) / ((total - warmup) * final)
            expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        assert learning_rate(consumed / final, o, total, size / final) == pytest.approx(expected, rel=1e-12)
        mtp = 0.1 if consumed >= o.mtp_loss_switch_step * final else model.mtp_loss_scaling_factor
        bias = 0.0 if consumed >= o.bias_update_switch_step * final else model.moe_router_bias_update_rate
        assert mtp_loss_scale(consumed / final, o, model) == mtp
        assert bias_update_rate(consumed / final, o, model) == bias
        consumed += size


CONFIG_REFUSALS = {
    "length": ("[4, 4]", "must be [start, increment, samples], three integers >= 1, got [4, 4]"),
    "zero": ("[4, 0, 16]", "three integers >= 1, got [4, 0, 16]"),
    "start-at-final": ("[8, 4, 16]", "start 8 must be below train.global_batch_size=8"),
    "increment": ("[2, 4, 16]", "train.global_batch_size - start = 6 is not a multiple of increment 4"),
    "one-process-split": ("[2, 2, 16]", "start 2 is not a multiple of train.micro_batch_size=4 x dp=1"),
}


@pytest.mark.parametrize("case", CONFIG_REFUSALS)
def test_a_bad_ramp_stops_the_trainer_with_exit_2_before_any_work(tmp_path, capsys, case):
    value, message = CONFIG_REFUSALS[case]
    run = tmp_path / "run"
    code = main(["--config", TINY, "--set", f"logging.dir={run}", "--set", f"train.rampup_batch_size={value}"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and "train.rampup_batch_size: " in err[0] \
        and message in err[0], err
    assert not run.exists()


@pytest.mark.parametrize("nproc, overrides, message", [
    (2, ["parallel.ep=2", "train.micro_batch_size=2", "train.rampup_batch_size=[2,2,16]"],
     "train.rampup_batch_size: start 2 is not a multiple of train.micro_batch_size=2 x dp=2"),
    (2, ["parallel.ep=2", "train.micro_batch_size=1", "train.rampup_batch_size=[2,1,16]"],
     "train.rampup_batch_size: increment 1 is not a multiple of train.micro_batch_size=1 x dp=2"),
    (2, ["parallel.ep=2", "train.micro_batch_size=1", "train.rampup_batch_size=[4,2,16]"], None),
    # dualpipev on pp 2 needs 4 micro-batches per step: 16 / (1 x dp 2) = 8 is fine, a step of 4 samples is 2
    (4, ["parallel.pp=2", "parallel.schedule=dualpipev", "train.micro_batch_size=1", "train.global_batch_size=16",
         "train.rampup_batch_size=[4,4,16]"],
     "train.rampup_batch_size: a step of 4 samples is 2 micro-batches per pipeline (train.micro_batch_size=1 x "
     "dp=2), which schedule dualpipev on pp=2 cannot run: microbatches: dualpipev needs microbatches >= 2*ranks"),
    (4, ["parallel.pp=2", "parallel.schedule=dualpipev", "train.micro_batch_size=1", "train.global_batch_size=16",
         "train.rampup_batch_size=[8,4,16]"], None),
], ids=["start-split", "increment-split", "split-fine", "schedule-count", "schedule-fine"])
def test_the_launcher_refuses_a_ramp_the_layout_or_schedule_cannot_run(capsys, nproc, overrides, message):
    """The launcher's check (the trainer's start-up checks, no process started): every step's batch must split
    into micro-batches over dp, and every step's micro-batch count must suit the pipeline schedule."""
    code = launch_info.main(["--config", TINY, "--nproc-per-node", str(nproc),
                             *(x for o in overrides for x in ("--set", o))])
    captured = capsys.readouterr()
    if message is None:
        assert code == 0 and captured.out == f"{nproc}\n", captured.err
        return
    lines = captured.err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: 1 node(s) x {nproc} process(es): ") \
        and message in lines[0], captured.err


def test_the_planner_plans_activations_at_the_largest_peak_of_every_steps_schedule():
    """zb-interleaved on pp 2 keeps 5 stage-micro-batches at its peak with 3 micro-batches per step and 4 with 4:
    a ramp through 3 plans the activations of the 3-micro-batch step, above the final batch's."""
    common = ["parallel.pp=2", "parallel.schedule=zb-interleaved", "parallel.virtual_stages=2",
              "train.micro_batch_size=1", "train.global_batch_size=4"]

    def planned(*extra: str) -> list[tuple[float, float]]:
        result = plan.make_plan(load_config(TINY, [*common, *extra]), nodes=1, gpus_per_node=2)
        return [(rank.activations, rank.peak_units) for rank in result.ranks]

    final, three, ramp = planned(), planned("train.global_batch_size=3"), planned("train.rampup_batch_size=[3,1,4]")
    assert ramp == three and all(r > f for (r, _), (f, _) in zip(ramp, final))
    assert [units for _, units in ramp] == [5.0, 5.0] and [units for _, units in final] == [4.0, 4.0]


def test_the_671b_recipe_uses_the_papers_ramp_on_a_layout_dualpipe_can_run(capsys):
    """3,072 -> 15,360 over 469 B tokens of 4,096 in the paper; DualPipe on 16 ranks needs 32 micro-batches per
    step, 4,096 samples on dp 128, so the recipe starts there (the paper's 3,072 is refused, naming the key).
    Its steps count final batches: the paper's 2,000 warm-up steps, all at the first batch, are 533 of them."""
    config = load_config(DSV3)
    ramp, o = batch_ramp(config.train), config.optim
    assert (ramp.start, ramp.final, ramp.samples) == (4096, 15360, 469_000_000_000 // 4096)
    assert ramp.walk(0, 2000 * 4096) == (2000, 2000 * 4096)  # the first 2,000 steps take 4,096 samples each
    assert o.lr_warmup_steps == 2000 * 4096 // 15360 and o.lr_warmup_steps + o.lr_constant_steps == 158946
    assert plan.main(["--config", DSV3, "--nodes", "256", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "batch ramp: the global batch ramps from 4096 by 1024 to 15360 over 114,501,953 samples " \
           "(train.rampup_batch_size): 32 to 120 micro-batches per pipeline, by 8" in out
    assert plan.main(["--config", DSV3, "--nodes", "256", "--gpus-per-node", "8",
                      "--set", "train.rampup_batch_size=[3072,1024,114501953]"]) == 2
    assert "train.rampup_batch_size: a step of 3072 samples is 24 micro-batches per pipeline " \
           "(train.micro_batch_size=1 x dp=128), which schedule dualpipe on pp=16 cannot run" in capsys.readouterr().err
    assert plan.main(["--config", DSV3, "--nodes", "256", "--gpus-per-node", "8",
                      "--set", "train.rampup_batch_size=[4160,1120,114501953]"]) == 2
    assert "train.rampup_batch_size: start 4160 is not a multiple of train.micro_batch_size=1 x dp=128" \
        in capsys.readouterr().err


def test_the_recipes_ramp_costs_0_11_percent_more_simulated_pipeline_time_and_no_memory():
    """The README's cost: 242,202 steps instead of 235,240 over the same samples (but a partial last batch),
    each paying DualPipe's bubble (F = B = W): 0.11% more simulated time; no step of the ramp keeps more
    micro-batches in flight than a final one; 12 micro-batch counts."""
    ramp = batch_ramp(load_config(DSV3).train)
    schedules = {size: simulate(build("dualpipe", 16, size // 128)) for size in ramp.sizes()}
    assert len(schedules) == 12
    assert all(max(t.peak_activations) <= max(schedules[ramp.final].peak_activations) for t in schedules.values())
    end = 235240 * ramp.final
    consumed, steps, ramped = 0, 0, 0.0
    while consumed < ramp.samples:
        ramped += schedules[ramp.batch_size(consumed)].makespan
        consumed += ramp.batch_size(consumed)
        steps += 1
    constant = (end - consumed) // ramp.final
    ramped += constant * schedules[ramp.final].makespan
    assert (steps + constant, ramp.walk(0, end)[0]) == (242202, 242202)
    assert f"{100 * (ramped / (235240 * schedules[ramp.final].makespan) - 1):.2f}%" == "0.11%"
