"""Config loading, overrides, validation messages and the YAML round trip."""
from pathlib import Path

import pytest
import yaml

from moe_train.config import ConfigError, load_config, to_yaml

CONFIGS = sorted(Path("moe_train/configs").glob("*.yaml"))


def problems_of(overrides, path=None):
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    return err.value.problems


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_configs_load_and_round_trip(path, tmp_path):
    config = load_config(path)
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(to_yaml(config))
    assert load_config(dumped) == config


def test_overrides_are_parsed_to_field_types():
    config = load_config("moe_train/configs/tiny.yaml", [
        "model.hidden_size=128", "optim.lr=1e-3", "train.precision=bf16", "parallel.zero1=false",
        "model.q_lora_rank=null", "optim.lr_decay_steps=7", "checkpoint.resume=/some/path"])
    assert config.model.hidden_size == 128 and isinstance(config.model.hidden_size, int)
    assert config.optim.lr == 1e-3 and isinstance(config.optim.lr, float)
    assert config.train.precision == "bf16" and config.parallel.zero1 is False
    assert config.model.q_lora_rank is None and config.optim.lr_decay_steps == 7
    assert config.checkpoint.resume == "/some/path"


def test_unknown_keys_suggest_the_right_name():
    assert problems_of(["model.hiden_size=3"]) == [("model.hiden_size", "unknown key (did you mean 'hidden_size'?)")]
    (key, message), = problems_of(["trian.steps=3"])
    assert key == "trian.steps" and "did you mean 'train'" in message


def test_wrong_types_name_the_key():
    (key, message), = problems_of(["train.steps=ten"])
    assert key == "train.steps" and "expected an integer" in message
    (key, message), = problems_of(["parallel.zero1=3"])
    assert key == "parallel.zero1" and "true or false" in message


@pytest.mark.parametrize("overrides,key,fragment", [
    (["model.num_moe_experts=10"], "model.moe_router_num_groups", "not divisible"),
    (["model.moe_router_group_topk=1", "model.moe_router_topk=3"], "model.moe_router_group_topk", "< moe_router_topk=3"),
    (["model.qk_pos_emb_head_dim=7"], "model.qk_pos_emb_head_dim", "even"),
    (["model.moe_router_num_groups=8"], "model.moe_router_num_groups", "top-2"),
    (["train.micro_batch_size=3"], "train.global_batch_size", "not a multiple"),
    (["model.rope_type=ntk"], "model.rope_type", "must be one of"),
    (["parallel.dispatcher=nccl"], "parallel.dispatcher", "must be one of"),
    (["parallel.ep=3"], "parallel.ep", "not divisible"),
    (["parallel.comm_sms=7"], "parallel.comm_sms", "must be even (2 SMs per channel)"),
    (["train.seq_length=8192"], "train.seq_length", "max_position_embeddings"),
    (["train.compile=full"], "train.compile", "must be one of none, regions, model"),
    (["train.compile=regions", "parallel.pp=2"], "train.compile", "needs parallel.pp=1"),
    (["model.recompute_modules=[layernorm,attention]"], "model.recompute_modules", "unknown module(s) 'attention'"),
    (["model.recompute_modules=[full,moe_act]"], "model.recompute_modules", "give it alone"),
    (["model.recompute_modules=[moe_act]", "train.compile=regions"], "train.compile", "saved-tensor hooks"),
    (["optim.moment_dtype=fp16"], "optim.moment_dtype", "must be one of fp32, bf16"),
    (["optim.moment_dtype=bf16", "optim.adam_beta2=0.999"], "optim.adam_beta2", "0.999 with optim.moment_dtype=bf16"),
    (["optim.moment_dtype=bf16", "optim.adam_beta1=0.997"], "optim.adam_beta1", "beta at most 0.99609375"),
])
def test_impossible_combinations(overrides, key, fragment):
    problems = problems_of(overrides, "moe_train/configs/tiny.yaml")
    assert any(k == key and fragment in m for k, m in problems), problems


def test_bf16_moments_take_betas_up_to_the_limit_and_fp32_moments_any():
    assert load_config(None, ["optim.moment_dtype=bf16", "optim.adam_beta2=0.99609375"]).optim.moment_dtype == "bf16"
    assert load_config(None, ["optim.adam_beta2=0.999"]).optim.adam_beta2 == 0.999


def test_invalid_yaml_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hidden_size: 64\n  num_layers: [1, 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert str(bad) in str(err.value) and "line" in str(err.value) and "invalid YAML" in str(err.value)


@pytest.mark.parametrize("text, line, key", [("train:\n  steps: 3\n  seed: 1\n  steps: 5\n", 4, "steps"),
                                             ("train:\n  steps: 3\noptim:\n  lr: 0.1\ntrain:\n  seed: 4\n", 5, "train")],
                         ids=["key", "section"])
def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path, text, line, key):
    """PyYAML keeps the last of two equal keys silently: the value the user reads higher up is not used."""
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"line {line}, column" in str(err.value) and f"key {key!r} is given twice (first on line" in str(err.value)


def test_section_must_be_mapping(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"train": [1, 2]}))
    assert problems_of([], bad) == [("train", "must be a mapping of keys")]


# Values a probe found giving a traceback or accepted silently: each stops at load with one line naming the key.
BAD_VALUES = [
    ("train.threads=-1", "train.threads", "must be an integer >= 1, or null"),
    ("train.threads=0", "train.threads", "must be an integer >= 1, or null"),
    ("parallel.timeout_s=inf", "parallel.timeout_s", "finite number of seconds"),
    ("parallel.timeout_s=0", "parallel.timeout_s", "finite number of seconds"),
    ("optim.lr=nan", "optim.lr", "finite number >= 0, got nan"),
    ("optim.lr=-1e-3", "optim.lr", "finite number >= 0"),
    ("optim.clip_grad=-1", "optim.clip_grad", "finite number >= 0, got -1"),
    ("optim.weight_decay=inf", "optim.weight_decay", "finite number >= 0, got inf"),
    ("train.peak_tflops=0", "train.peak_tflops", "finite number > 0"),
    ("train.max_skipped_steps=0", "train.max_skipped_steps", "must be an integer >= 1"),
]


@pytest.mark.parametrize("override,key,message", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_values_stop_at_load_naming_the_key(override, key, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    messages = dict(info.value.problems)
    assert key in messages and message in messages[key], info.value.problems


def test_an_empty_config_file_is_refused(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing set\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_config(empty)


def test_cuda_without_a_gpu_is_a_config_error_naming_the_key():
    import torch

    from moe_train.runtime import select_device

    config = load_config(None, ["train.device=cuda"])
    if torch.cuda.is_available():
        assert select_device(config.train).type == "cuda"
        return
    with pytest.raises(ConfigError, match="train.device: cuda, but CUDA is not available"):
        select_device(config.train)


def test_data_paths_take_a_prefix_or_a_blend_string_or_list():
    config = load_config("moe_train/configs/tiny.yaml", ["data.path=0.3 a 0.7 b", "data.valid_path=[1, v.idx]"])
    assert config.data.path == "0.3 a 0.7 b" and config.data.valid_path == ["1", "v.idx"]
    assert config.data.split_fraction == 0.0  # valid_path replaces the default held-out 1 %
    assert load_config(None, []).data.split_fraction == 0.01


@pytest.mark.parametrize("overrides,key,fragment", [
    (["data.path=0.3 a 0.7"], "data.path", "neither one prefix nor a blend"),
    (["data.path=[0.5, a, -0.5, b]"], "data.path", "finite numbers > 0"),
    (["data.valid_path=1 x y"], "data.valid_path", "neither one prefix nor a blend"),
    (["data.valid_path=v", "data.valid_fraction=0.1"], "data.valid_path", "together with data.valid_fraction"),
    (["data.path={a: 1}"], "data.path", "expected a string or a list"),
    (["logging.wandb_mode=cloud"], "logging.wandb_mode", "must be one of offline, online"),
])
def test_bad_data_paths_and_wandb_mode_name_the_key(overrides, key, fragment):
    (got_key, message), = problems_of(overrides)
    assert got_key == key and fragment in message, message


@pytest.mark.parametrize("old, modules", [("full", ["full"]), ("null", [])])
def test_an_older_configs_recompute_granularity_reads_as_recompute_modules(tmp_path, old, modules):
    """Run directories and checkpoints written before recompute_modules hold `recompute_granularity`."""
    path = tmp_path / "old.yaml"
    path.write_text(f"model:\n  recompute_granularity: {old}\n")
    assert load_config(path).model.recompute_modules == modules
