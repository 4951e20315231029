"""Combined 1F1B (1F1B with its steady-state pairs overlapped) trains like the single-process run,
and bitwise like itself without overlap (pp 2, ep 2 over 2 simulated nodes, gloo, CPU)."""
import math

import torch

from moe_train.optim import set_learning_rate
from moe_train.schedules import learning_rate
from moe_train.train import Trainer, read_metrics
from parallel.data_parallel import is_expert_parameter
from parallel.topology import build_topology
from tests.distributed.test_training import corpus_cache, tiny_config  # noqa: F401 - corpus_cache is a fixture

SHORT = ("train.seq_length=16", "train.global_batch_size=16")
STEPS = 2


def run_steps(trainer: Trainer) -> list[dict]:
    """Per step: the losses, the reduced range of every gradient before clipping (the rank's ZeRO-1 pieces:
    (first expert or None, first element, the parameter's shape, the range)) and the gradient norm."""
    first_expert = {n: m.experts.first_expert for n, m in trainer.model.named_modules() if hasattr(m, "experts")}
    steps = []
    for step in range(STEPS):
        set_learning_rate(trainer.optimizer, learning_rate(step, trainer.cfg.optim, trainer.cfg.train.steps))
        [losses] = read_metrics([trainer.compute_gradients()])
        grads = {p.name: (first_expert[p.name.split(".experts.")[0]] if is_expert_parameter(p.name) else None,
                          p.start, tuple(p.param.shape), p.grad.clone())
                 for p in trainer.optimizer.pieces}
        [update] = read_metrics([trainer.apply_update()])
        steps.append({"losses": losses, "grads": grads, "grad_norm": update["grad_norm"]})
    return steps


def train_both_ways(cache_dir: str, run_dir: str) -> dict:
    import torch.distributed as dist

    out = {}
    for overlap in (False, True):
        topology = build_topology(pp=2, ep=2, gpus_per_node=1, timeout_s=60)
        trainer = None
        try:
            config = tiny_config(cache_dir, f"{run_dir}_{overlap}", *SHORT, "parallel.pp=2", "parallel.ep=2",
                                 "parallel.schedule=combined-1f1b", "parallel.dispatcher=hierarchical",
                                 f"parallel.overlap={str(overlap).lower()}")
            trainer = Trainer(config, topology)
            steps = run_steps(trainer)
            hook = trainer.pipeline.runtime.fb_overlap
            out[overlap] = {"steps": steps, "stats": None if hook is None else (hook.stats.pairs, hook.stats.hidden)}
        finally:
            if trainer is not None:
                trainer.pipeline.destroy()
            topology.destroy_groups()
            dist.barrier()
    return out


def test_combined_1f1b_overlap_equals_single_process_and_no_overlap(pools, corpus_cache, tmp_path):  # noqa: F811
    reference = run_steps(Trainer(tiny_config(corpus_cache, str(tmp_path / "ref"), *SHORT)))
    results = pools.get(4).run(train_both_ways, corpus_cache, str(tmp_path / "run"), deadline_s=300)
    for rank, result in enumerate(results):
        plain, overlapped = result[False], result[True]
        pairs, hidden = overlapped["stats"]
        assert pairs > 0 and hidden > 0, rank
        for got, want, ref in zip(overlapped["steps"], plain["steps"], reference):
            assert got["losses"] == want["losses"], rank
            assert got["grad_norm"] == want["grad_norm"], rank
            torch.testing.assert_close(got["grad_norm"], ref["grad_norm"], rtol=1e-5, atol=0)
            for key in ("loss", "lm_loss", "mtp_loss"):
                torch.testing.assert_close(got["losses"][key], ref["losses"][key], rtol=1e-5, atol=0)
            assert any(grad.any() for *_, grad in want["grads"].values())
            for name, (expert, start, shape, grad) in got["grads"].items():
                assert torch.equal(grad, want["grads"][name][3]), (rank, name)
                expected = ref["grads"][name][3]  # one process: the whole gradient
                if expert is not None:
                    per_expert = math.prod(shape[1:])
                    expected = expected[expert * per_expert:(expert + shape[0]) * per_expert]
                torch.testing.assert_close(grad, expected[start:start + grad.numel()], rtol=1e-5, atol=4e-5,
                                           msg=f"rank {rank} grad {name}")
