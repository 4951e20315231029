"""A layout-changing resume runs no code from the checkpoint: a one-process checkpoint with a payload in
its .metadata, extra.pt or RNG file, resumed by dp 2 x ep 2, is refused on every rank naming the file,
and the payload never runs (tests/unit/test_checkpoint_trust.py has the other readers)."""
import shutil

import pytest

from moe_train.checkpoint.dcp import CheckpointError
from moe_train.train import Trainer
from parallel.topology import build_topology
from tests.distributed.test_training import corpus_cache, tiny_config  # noqa: F401 - corpus_cache is a fixture
from tests.unit.crafted_checkpoint import PLANTED_FILES, plant


def resume_on_ep2(cache_dir: str, run_dir: str, folder: str) -> str:
    """Each rank's error on resuming `folder` with dp 2 x ep 2 ('' if it resumed)."""
    import torch.distributed as dist

    topology = build_topology(pp=1, ep=2, gpus_per_node=2, timeout_s=60)
    try:
        Trainer(tiny_config(cache_dir, run_dir, "parallel.ep=2", f"checkpoint.resume={folder}"), topology)
        return ""
    except CheckpointError as err:
        return str(err)
    finally:
        topology.destroy_groups()
        dist.barrier()


@pytest.fixture(scope="module")
def one_process_checkpoint(tmp_path_factory, corpus_cache):  # noqa: F811
    run = tmp_path_factory.mktemp("trust") / "run"
    trainer = Trainer(tiny_config(corpus_cache, str(run), "train.steps=1"))
    trainer.train_step()
    return trainer.save()


@pytest.mark.parametrize("name", PLANTED_FILES)
def test_a_planted_payload_stops_a_layout_changing_resume_on_every_rank(pools, corpus_cache, tmp_path,  # noqa: F811
                                                                        one_process_checkpoint, name):
    folder = tmp_path / one_process_checkpoint.name
    shutil.copytree(one_process_checkpoint, folder)
    marker = tmp_path / "marker"
    file = plant(folder, name, marker)
    errors = pools.get(2).run(resume_on_ep2, corpus_cache, str(tmp_path / "run"), str(folder), deadline_s=120)
    for error in errors:
        assert f"{file}: refused to load posix.system" in error and "\n" not in error, errors
    assert not marker.exists(), "the payload ran"
