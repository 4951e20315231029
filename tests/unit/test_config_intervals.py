"""Every numeric config key has a declared range (model.intervals), and values outside it stop at
load with one line naming the key: NaN, infinities and values just past each bound. The values are
derived from the declared intervals, so a key added without a range, or a range the validation
ignores, fails here. No random inputs are drawn."""
import dataclasses
import math
import typing

import pytest

from model.args import INTERVALS as MODEL_INTERVALS
from model.intervals import Interval
from moe_train.config import INTERVALS, Config, ConfigError, load_config

CHECKED_ELSEWHERE = {  # numeric keys whose range depends on other keys, with where it is checked
    "model.moe_router_num_groups": "ModelArgs._router_problems, against num_moe_experts",
    "model.moe_router_group_topk": "ModelArgs._router_problems, against the group count",
    "logging.profile_ranks": "config.validate, each rank of the list >= 0",
}


def numeric_keys() -> dict[str, type]:
    keys = {}
    for section in dataclasses.fields(Config):
        hints = typing.get_type_hints(section.type if isinstance(section.type, type) else type(getattr(Config(), section.name)))
        for f in dataclasses.fields(getattr(Config(), section.name)):
            kinds = [a for a in (typing.get_args(hints[f.name]) or (hints[f.name],)) if a is not type(None)]
            if kinds and kinds[0] in (int, float):
                keys[f"{section.name}.{f.name}"] = kinds[0]
    return keys


def declared() -> dict[str, Interval]:
    intervals = {f"model.{key}": interval for key, interval in MODEL_INTERVALS.items()}
    for section, table in INTERVALS.items():
        intervals.update({f"{section}.{key}": interval for key, interval in table.items()})
    return intervals


def test_every_numeric_key_has_a_declared_range():
    missing = sorted(set(numeric_keys()) - set(declared()) - set(CHECKED_ELSEWHERE))
    assert not missing, f"numeric config keys without an Interval: {missing}"
    assert not set(declared()) - set(numeric_keys()), "intervals declared for keys that do not exist"


def outside(interval: Interval, kind: type) -> list[str]:
    """Override values just outside `interval`, and the non-finite ones for a float key."""
    step = 1 if kind is int else 0.5
    values = []
    if interval.low is not None:
        values.append(interval.low if interval.low_open else interval.low - step)
    if interval.high is not None:
        values.append(interval.high if interval.high_open else interval.high + step)
    texts = [str(int(v)) if kind is int else repr(float(v)) for v in values]
    if kind is float:
        texts += ["nan", "inf", "-inf"]
    if not interval.optional:
        texts.append("null")
    return texts


CASES = [(key, text) for key, kind in numeric_keys().items() if key in declared()
         for text in outside(declared()[key], kind)]


@pytest.mark.parametrize("key,text", CASES, ids=[f"{k}={t}" for k, t in CASES])
def test_a_value_outside_the_range_stops_at_load_naming_the_key(key, text):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{key}={text}"])
    assert key in dict(info.value.problems), info.value.problems


def test_the_defaults_and_the_bounds_themselves_are_allowed():
    config = Config()
    for key, interval in declared().items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        assert interval.problem(value) is None, f"{key}'s default {value} is outside its own range"
        for bound, is_open in ((interval.low, interval.low_open), (interval.high, interval.high_open)):
            if bound is not None and not is_open and math.isfinite(bound):
                assert interval.problem(bound) is None, (key, bound)
