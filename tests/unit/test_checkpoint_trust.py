"""Loading a checkpoint runs no code from it: a payload planted in DCP's .metadata, extra.pt or an RNG
file is refused in one line with exit 2 by every reader (resume, weights-only resume, export,
generation), and never runs (its marker file never appears). The layout-changing resume is in
tests/distributed/test_checkpoint_trust.py."""
import shutil
from pathlib import Path

import pytest

from moe_train.checkpoint.hf import main as hf_main
from moe_train.generate.cli import main as generate_main
from moe_train.train import EXIT_BAD_INPUT, main as train_main
from tests.unit.crafted_checkpoint import plant
from tests.unit.test_train import TINY, cache_dir, overrides  # noqa: F401 - cache_dir is a fixture


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir):  # noqa: F811
    """A real checkpoint: one step of the tiny config (model, optimizer, extra, RNG, config.yaml)."""
    run = tmp_path_factory.mktemp("trust") / "run"
    assert train_main(["--config", TINY, *overrides(run, cache_dir, "train.steps=1")]) == 0
    return run / "checkpoints" / "iter_0000001"


def _refusal(file: Path) -> str:
    return f"error: {file}: refused to load posix.system: checkpoints of this program never hold code"


def _resume(folder: Path, run: Path, cache: str, *extra: str) -> int:
    return train_main(["--config", TINY, *overrides(run, cache, f"checkpoint.resume={folder}", "train.steps=2",
                                                    *extra)])


READERS = {
    "resume": lambda folder, work, cache: _resume(folder, work / "run", cache),
    "weights-only resume": lambda folder, work, cache: _resume(folder, work / "run", cache,
                                                               "checkpoint.weights_only=true"),
    "export": lambda folder, work, cache: hf_main(["export", str(folder), str(work / "hf")]),
    "generation": lambda folder, work, cache: generate_main(["--config", TINY, "--checkpoint", str(folder),
                                                             "--prompt", "def", "--max-new-tokens", "1"]),
}
# which readers read which file: weights-only loads, export and generation read no training state
CASES = [(".metadata", reader) for reader in READERS] + [(name, "resume") for name in ("extra.pt", "rng_rank0.pt")]


@pytest.mark.parametrize("name, reader", CASES, ids=[f"{n}-{r}" for n, r in CASES])
def test_a_planted_payload_is_refused_in_one_line_and_never_runs(trained, cache_dir, tmp_path, capsys,  # noqa: F811
                                                                 name, reader):
    folder = tmp_path / "iter_0000001"
    shutil.copytree(trained, folder)
    marker = tmp_path / "marker"
    file = plant(folder, name, marker)
    capsys.readouterr()
    assert READERS[reader](folder, tmp_path, cache_dir) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    lines = [line for line in captured.out.splitlines() + captured.err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith(_refusal(file)), captured
    assert "Traceback" not in captured.err and "weights_only" not in captured.err
    assert not marker.exists(), "the payload ran"


def test_the_unplanted_checkpoint_loads_in_every_reader(trained, cache_dir, tmp_path):  # noqa: F811
    """The same readers on the checkpoint as written: the refusals above come from the payload alone."""
    for reader, run in READERS.items():
        work = tmp_path / reader.replace(" ", "-")
        work.mkdir()
        assert run(trained, work, cache_dir) == 0, reader
