"""Training with a batch ramp (train.rampup_batch_size) on one process: every step equals a hand-driven run
of a trainer without a ramp (the step's samples, its micro-batches, its mean loss and the learning rate
written in samples here), the log shows each step's batch, consumed samples and tokens/s, and resuming
mid-ramp, also under a changed ramp, continues bit for bit. No random seeds are drawn: the runs use the
tiny config's train.seed (printed)."""
import contextlib
import io
import math
from types import SimpleNamespace

import pytest

import moe_train.train
from moe_train.checkpoint.dcp import iteration_dir
from moe_train.config import load_config
from moe_train.optim import set_learning_rate
from moe_train.moe_metrics import MOE_LAYERS
from moe_train.train import Trainer, main, read_metrics
from tests.unit.test_batch_ramp import megatron_batch
from tests.unit.test_train import TINY, cache_dir, overrides, records  # noqa: F401 - cache_dir is a fixture

FINAL, MICRO, SEQ = 8, 2, 64  # the tiny config's batch and sequence, with micro-batches of 2
RAMP = (2, 2, 12)  # 2, 2, 4, 6, then 8 from 12 consumed samples on
CHANGED = (4, 4, 20)  # resumed after 4 samples: 4 until 20 consumed samples, then 8
# 3 final batches (24 samples), warm-up over the first 8 samples, then the cosine over the other 16; the MTP
# weight (0.3 -> 0.1) and the router bias rate (1e-3 -> 0) switch for the steps from 8 consumed samples on
COMMON = ("train.steps=3", "optim.lr_warmup_steps=1", f"train.micro_batch_size={MICRO}", "train.log_interval=1",
          "optim.mtp_loss_switch_step=1", "optim.bias_update_switch_step=1")


def ramp_setting(ramp: tuple[int, int, int]) -> str:
    return f"train.rampup_batch_size=[{','.join(map(str, ramp))}]"


def hand_steps(ramp: tuple[int, int, int], consumed: int, end: int, count: int | None = None) -> list[tuple[int, int]]:
    """(samples consumed before, batch) of each step from `consumed`, by Megatron's formula, while a whole
    batch fits in `end` samples (at most `count` steps)."""
    steps = []
    while count is None or len(steps) < count:
        size = megatron_batch(consumed, *ramp, FINAL)
        if consumed + size > end:
            break
        steps.append((consumed, size))
        consumed += size
    return steps


def hand_lr(consumed: int, size: int) -> float:
    """The tiny config's learning rate (3e-3 -> 3e-4) in samples: warm-up over 8, cosine over 16."""
    lr, min_lr = 3e-3, 3e-4
    if consumed < 8:
        return lr * min(consumed + size, 8) / 8
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * min((consumed - 8) / 16, 1.0)))


def hand_driven(run_dir, cache_dir, steps: list[tuple[int, int]]) -> list[dict]:
    """A trainer without a ramp, driven by hand: step (c, b) takes samples [c, c + b) as b / 2 micro-batches,
    the mean of their losses (each micro-batch's loss / count backward) with the MTP weight of c, the learning
    rate of hand_lr, then the trainer's clipping, AdamW and bias update, at the bias rate of c (the trainer's
    own switch unset)."""
    config = load_config(TINY, overrides(run_dir, cache_dir, *COMMON, "optim.bias_update_switch_step=null")[1::2])
    trainer = Trainer(config)
    assert trainer.ramp.samples == 0
    print(f"seed {trainer.cfg.train.seed}")
    results = []
    for consumed, size in steps:
        trainer.cfg.model.moe_router_bias_update_rate = 0.0 if consumed >= 8 else 1e-3
        mtp_weight = 0.1 if consumed >= 8 else 0.3
        lr = hand_lr(consumed, size)
        set_learning_rate(trainer.optimizer, lr)
        count = size // MICRO
        loss = 0.0
        for i in range(count):
            rows = trainer.train_data.rows(consumed + i * MICRO, MICRO)
            out = trainer.model(rows[:, :-1], rows[:, 1:], mtp_loss_scale=mtp_weight, aux_grad_scale=1.0 / count)
            (out.loss * (1.0 / count)).backward()
            loss = loss + out.loss.detach().double() * (1.0 / count)
        trainer.grads.finish()
        update = read_metrics([trainer.apply_update()])[0]
        spreads = {k: v for k, v in trainer.moe_metrics.record(update[MOE_LAYERS]).items() if k.endswith("bias_spread")}
        results.append({"loss": loss.item(), "lr": lr, "grad_norm": update["grad_norm"],
                        "global_batch_size": size, "consumed_samples": consumed + size, **spreads})
    return results


def logged(run_dir, first_step: int = 1) -> list[dict]:
    """Each record's figures that hand_driven gives (the router biases' spread of every MoE layer included)."""
    keys = ("loss", "lr", "grad_norm", "global_batch_size", "consumed_samples")
    return [{k: v for k, v in r.items() if k in keys or k.endswith("bias_spread")}
            for r in records(run_dir) if r["step"] >= first_step]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache_dir):
    """The ramp 2, 2, 4, 6, 8 over 24 samples, checkpoints after steps 2 and 4, under a clock that advances
    1 s per reading; (run folder, console output)."""
    run = tmp_path_factory.mktemp("straight")
    clock = iter(range(10**6))
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()) as out:
        patch.setattr(moe_train.train, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
        assert main(["--config", TINY, *overrides(run, cache_dir, *COMMON, ramp_setting(RAMP),
                                                  "checkpoint.interval=2", "checkpoint.keep=3")]) == 0
    return run, out.getvalue()


def test_ramped_steps_equal_hand_driven_steps_and_log_their_batch(tmp_path, cache_dir, straight):
    """Every step's loss, learning rate and gradient norm are the hand-driven step's bit for bit; each record
    names its batch and the samples consumed after it, and tokens/s counts the step's own batch."""
    run, out = straight
    expected = hand_driven(tmp_path / "hand", cache_dir, hand_steps(RAMP, 0, 3 * FINAL))
    assert [r["global_batch_size"] for r in expected] == [2, 2, 4, 6, 8]
    assert logged(run) == expected
    assert [r["tokens_per_s"] for r in records(run)] == [r["global_batch_size"] * SEQ for r in expected]
    assert "training 5 steps from step 0" in out and "the global batch ramps from 2 by 2 to 8 over 12 samples" in out
    assert "step 3/5 | batch 4 (8 samples) |" in out and "done: 5 steps" in out


def test_resume_mid_ramp_is_bit_exact(tmp_path, cache_dir, straight):
    """Resumed from the checkpoint after step 2 (4 samples consumed, batch 4 next), steps 3 to 5 are the
    uninterrupted run's."""
    run, _ = straight
    at_2 = f"checkpoint.resume={iteration_dir(run / 'checkpoints', 2)}"
    resumed = tmp_path / "resumed"
    assert main(["--config", TINY, *overrides(resumed, cache_dir, *COMMON, ramp_setting(RAMP), at_2)]) == 0
    assert logged(resumed, 3) == logged(run, 3)


def test_resume_under_a_changed_ramp_continues_from_the_consumed_samples(tmp_path, cache_dir, straight):
    """Resumed after step 2 with the ramp changed to 4, 4 until 20 consumed samples: the run continues from its
    4 consumed samples on the new ramp, bit for bit as the hand-driven steps switched to it after step 2."""
    run, _ = straight
    switched = hand_driven(tmp_path / "hand", cache_dir,
                           hand_steps(RAMP, 0, 3 * FINAL, count=2) + hand_steps(CHANGED, 4, 3 * FINAL))
    assert [r["global_batch_size"] for r in switched] == [2, 2, 4, 4, 4, 4]
    at_2 = f"checkpoint.resume={iteration_dir(run / 'checkpoints', 2)}"
    changed = tmp_path / "changed"
    assert main(["--config", TINY, *overrides(changed, cache_dir, *COMMON, ramp_setting(CHANGED), at_2)]) == 0
    assert logged(changed, 3) == switched[2:]
