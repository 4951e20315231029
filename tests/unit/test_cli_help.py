"""The CLI explains itself: the launcher's --help, the trainer's key list, --print-config."""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_train.config import SECTIONS, Config, load_config
from moe_train.config.help import key_descriptions
from moe_train.train import main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "moe_train/configs/tiny.yaml")


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_the_launcher_prints_its_usage_and_exits_0(flag):
    res = subprocess.run(["bash", str(ROOT / "scripts/pretrain_dsv3.sh"), TINY, "--set", "train.steps=1", flag],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHON": sys.executable})
    assert res.returncode == 0 and not res.stderr, res.stderr
    assert res.stdout.startswith("Launch DeepSeek-V3-style MoE pretraining.\n")
    assert "bash scripts/pretrain_dsv3.sh [CONFIG] [--set section.key=value ...]" in res.stdout
    assert "#SBATCH" not in res.stdout and "set -euo" not in res.stdout


def test_the_launcher_prints_the_resolved_config_and_starts_nothing(tmp_path):
    run = tmp_path / "run"
    res = subprocess.run(["bash", str(ROOT / "scripts/pretrain_dsv3.sh"), TINY, "--print-config", "--set",
                          "train.steps=7", "--set", f"logging.dir={run}"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHON": sys.executable})
    assert res.returncode == 0 and not res.stderr, res.stderr
    printed = tmp_path / "printed.yaml"
    printed.write_text(res.stdout)
    assert load_config(printed) == load_config(TINY, ["train.steps=7", f"logging.dir={run}"])
    assert not run.exists()


def test_every_config_key_is_listed_with_type_default_and_description(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    defaults = Config()
    for section in SECTIONS:
        cls = type(getattr(defaults, section))
        names = [f.name for f in dataclasses.fields(cls)]
        assert set(key_descriptions(cls)) == set(names), f"{cls.__name__}: docstring keys differ from the fields"
        assert f"{section}: " in "\n".join(lines)
        for name in names:
            line = next((x for x in lines if x.startswith(f"  {section}.{name} (")), None)
            assert line is not None, f"{section}.{name} is not listed"
            head, _, description = line.partition("): ")
            assert ", default " in head and len(description.split()) >= 2, line
    assert "  train.steps (int, default 100): optimizer steps to train" in lines
    assert any(x.startswith("  data.path (str | list of str | null, default null): ") for x in lines)


def test_print_config_prints_yaml_that_loads_back(tmp_path, capsys):
    overrides = ["--set", "train.steps=7", "--set", "data.path=[0.3, a, 0.7, b.bin]"]
    assert main(["--print-config", TINY, *overrides]) == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    expected = load_config(TINY, ["train.steps=7", "data.path=[0.3, a, 0.7, b.bin]"])
    assert load_config(printed) == expected and expected.train.steps == 7
    run = tmp_path / "run"
    assert main(["--config", TINY, "--print-config", "--set", f"logging.dir={run}"]) == 0  # the file from --config
    assert capsys.readouterr().out.startswith("model:\n") and not run.exists()  # printed, nothing started


def test_print_config_keeps_the_error_messages(capsys):
    assert main(["--print-config", TINY, "--set", "train.stepz=3"]) == 2
    assert capsys.readouterr().err == f"error: {TINY}: train.stepz: unknown key (did you mean 'steps'?)\n"
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2 and "the following arguments are required: --config" in capsys.readouterr().err
