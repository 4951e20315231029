"""HF interop with 4 processes (pp 2 x dp 2, ep 2): training starts from a folder made and saved by
transformers (no MTP layer; the model section adopts its config), each rank reading only its stage's
and its experts' tensors, with the single-process first losses; the 4 ranks export the training
checkpoint together and transformers loads it with our logits and greedy output
(tests/unit/test_hf_training.py's checks)."""
import pytest

from moe_train.checkpoint.dcp import iteration_dir
from moe_train.train import Trainer, read_metrics
from parallel.topology import build_topology
from tests.distributed.test_training import corpus_cache, tiny_config  # noqa: F401 - corpus_cache is a fixture
from tests.unit.test_hf_training import check_export, transformers_model

pytest.importorskip("transformers")

LAYOUT = ("train.seq_length=16", "train.global_batch_size=8", "train.steps=2")
# the keys in which transformers_model's config differs from tiny.yaml (what the refusal tells one to --set)
ADOPT = ("model.norm_epsilon=1e-05", "model.moe_router_topk_scaling_factor=1.5", "model.mtp_num_layers=0",
         "model.init_method_std=0.1")


def train_and_export(cache_dir: str, run_dir: str, hf_dir: str, export_dir) -> dict:
    import torch.distributed as dist

    from moe_train.checkpoint.hf_export import export

    topology = build_topology(pp=2, ep=2, gpus_per_node=1, timeout_s=60)
    trainer = None
    try:
        config = tiny_config(cache_dir, run_dir, *LAYOUT, *ADOPT, "parallel.pp=2", "parallel.ep=2", "parallel.schedule=zb-h1",
                             "parallel.dispatcher=hierarchical", f"checkpoint.resume={hf_dir}",
                             "checkpoint.weights_only=true")
        trainer = Trainer(config, topology)
        owned = sum(t.numel() for t in trainer.model.state_dict().values())
        metrics = read_metrics([trainer.train_step() for _ in range(2)])
        trainer.save()
        export(iteration_dir(config.checkpoint_dir, 2), export_dir, process_group=dist.group.WORLD)
        return {"metrics": metrics, "owned": owned}
    finally:
        if trainer is not None:
            trainer.pipeline.destroy()
        topology.destroy_groups()
        dist.barrier()


def test_four_processes_train_from_hf_and_export(pools, corpus_cache, tmp_path):  # noqa: F811
    hf_dir = tmp_path / "hf"
    transformers_model(hf_dir, seed=41)
    reference = Trainer(tiny_config(corpus_cache, str(tmp_path / "ref"), *LAYOUT, *ADOPT,
                                    f"checkpoint.resume={hf_dir}", "checkpoint.weights_only=true"))
    expected = read_metrics([reference.train_step() for _ in range(2)])
    total = sum(t.numel() for t in reference.model.state_dict().values())
    results = pools.get(4).run(train_and_export, corpus_cache, str(tmp_path / "run"), str(hf_dir),
                               tmp_path / "export", deadline_s=300)
    for result in results:
        assert result["owned"] < 0.75 * total, (result["owned"], total)  # a stage, half of its experts
        for got, want in zip(result["metrics"], expected):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    check_export(iteration_dir(tmp_path / "run" / "checkpoints", 2), tmp_path / "export", seed=43)
