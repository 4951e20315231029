"""logging.memory_snapshot without a GPU: refused at start-up with one line naming the key (exit 2, nothing
written), the probe of torch's private API, and the trainer's hook with that API faked (recording from
before the model is built, one snapshot after the first step, published whole, recording stopped). The
CUDA run is in tests/gpu/test_memory_snapshot.py. No random inputs are drawn."""
import pickle
from pathlib import Path

import torch

from model.transformer import DeepSeekV3
from moe_train.config import load_config
from moe_train.memory_snapshot import memory_snapshot_problem
from moe_train.preflight.launch_info import main as launch_info
from moe_train.train import Trainer, main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "moe_train/configs/tiny.yaml")


def test_a_cpu_run_is_refused_with_one_line_naming_the_key(tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["--config", TINY, "--set", f"logging.dir={run}", "--set", "train.device=cpu",
                 "--set", "logging.memory_snapshot=true"])
    err = capsys.readouterr().err
    assert code == 2 and err == (f"error: logging.memory_snapshot: true needs CUDA (the CUDA caching allocator's "
                                 f"history); this run is on cpu\n"), err
    assert not run.exists()
    # the launcher's check, before it starts 2 workers
    assert launch_info(["--config", TINY, "--nproc-per-node", "2", "--set", "train.device=cpu",
                        "--set", "logging.memory_snapshot=true"]) == 2
    assert capsys.readouterr().err == (f"error: 1 node(s) x 2 process(es): logging.memory_snapshot: true needs CUDA "
                                       f"(the CUDA caching allocator's history); this run is on cpu\n")


def test_a_torch_without_the_history_api_is_refused(monkeypatch):
    assert memory_snapshot_problem("cuda") is None  # this torch has both functions (even without CUDA)
    monkeypatch.delattr(torch.cuda.memory, "_snapshot")
    assert memory_snapshot_problem("cuda") == ("true, but this torch has no torch.cuda.memory._snapshot to record "
                                               "the allocator history")


def test_the_trainer_writes_one_snapshot_after_the_first_step(tmp_path, monkeypatch, capsys):
    calls = []

    class Model(DeepSeekV3):
        def __init__(self, *args, **kwargs):
            calls.append(("model",))
            super().__init__(*args, **kwargs)

    def snapshot():
        calls.append(("snapshot",))
        return {"segments": [], "device_traces": [[{"action": "alloc", "size": 512}]]}

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", **kwargs: calls.append(("record", enabled)))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", snapshot)
    monkeypatch.setattr("moe_train.train.memory_snapshot_problem", lambda device_type: None)
    monkeypatch.setattr("moe_train.train.DeepSeekV3", Model)
    run = tmp_path / "run"
    config = load_config(TINY, [f"logging.dir={run}", "logging.tensorboard=false", "train.steps=2", "train.threads=1",
                                "train.global_batch_size=4", f"data.cache_dir={tmp_path / 'cache'}",
                                "data.demo_max_bytes=200000", "logging.memory_snapshot=true"])
    trainer = Trainer(config)
    assert calls == [("record", "all"), ("model",)]  # recording began before the model was built
    assert trainer.train() == 0
    assert calls[2:] == [("snapshot",), ("record", None)]  # once, after the first step, then stopped
    path = run / "memory_snapshot" / "rank0_step1.pickle"
    assert pickle.loads(path.read_bytes()) == snapshot()
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary file left
    assert f"memory snapshot through step 1 written to {path} (pytorch.org/memory_viz)" in capsys.readouterr().out
