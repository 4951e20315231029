"""`python -m moe_train.plan`'s parameters, gradients and Adam state equal a real run's, byte for byte:
the tiny config on EP 2 x PP 2 (4 gloo processes, ZeRO-1 over dp 2), the stage cut the planner
assumes (layers 0-2 | layer 3, head and MTP). Adam state is its two moments plus a 4-byte step count per
owned piece of a parameter, which the planner bounds by one per tensor."""
from moe_train.preflight import plan
from moe_train.train import Trainer
from parallel.data_parallel import is_expert_parameter
from parallel.mixed_precision import current_grad
from parallel.topology import build_topology
from tests.distributed.test_training import corpus_cache, tiny_config  # noqa: F401 - corpus_cache is a fixture

LAYOUT = ("parallel.pp=2", "parallel.ep=2", "parallel.first_stage_layers=3", "train.micro_batch_size=4")


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def state_bytes(cache_dir: str, run_dir: str) -> dict:
    import torch.distributed as dist

    topology = build_topology(pp=2, ep=2, gpus_per_node=2, timeout_s=60)
    trainer = None
    try:
        trainer = Trainer(tiny_config(cache_dir, f"{run_dir}{dist.get_rank()}", *LAYOUT), topology)
        trainer.compute_gradients()
        named = list(trainer.model.named_parameters())
        params = [p for _, p in named]
        out = {"pp_rank": topology.pp_rank,
               "dense": sum(p.numel() for n, p in named if not is_expert_parameter(n)),
               "expert": sum(p.numel() for n, p in named if is_expert_parameter(n)),
               "weights": _bytes(params), "grads": _bytes(current_grad(p) for p in params)}
        trainer.apply_update()
        out["adam"] = _bytes(t for state in trainer.optimizer.state.values() for k, t in state.items() if k != "step")
        out["steps"] = len(trainer.optimizer.state)  # one 4-byte step count per piece
        out["tensors"] = len(named)
        return out
    finally:
        if trainer is not None:
            trainer.pipeline.destroy()
        topology.destroy_groups()
        dist.barrier()


def test_planned_parameters_gradients_and_adam_state_equal_the_trainers(pools, corpus_cache, tmp_path):  # noqa: F811
    config = tiny_config(corpus_cache, str(tmp_path / "plan"), *LAYOUT)
    planned = plan.make_plan(config, nodes=2, gpus_per_node=2)
    measured = pools.get(4).run(state_bytes, corpus_cache, str(tmp_path / "run"), deadline_s=180)
    for rank in planned.ranks:
        mine = [m for m in measured if m["pp_rank"] == rank.pp_rank]
        assert len(mine) == 2
        assert all((m["dense"], m["expert"]) == (rank.dense_params, rank.expert_params) for m in mine), (rank, mine)
        assert all((m["weights"], m["grads"]) == (rank.weights, rank.grads) for m in mine), (rank, mine)
        assert rank.main_params == 0  # fp32: the parameters are the master weights
        # ZeRO-1 cuts each bucket evenly: the first dp rank's share is the planned one, the last one's
        # falls short by the bucket's padding (fewer than dp elements per bucket)
        # the planner bounds the step counts by one per tensor of the rank (a piece per tensor at most)
        steps = 4 * mine[0]["tensors"]
        assert max(m["adam"] for m in mine) == rank.optimizer - steps, (rank, mine)
        assert rank.optimizer - steps - min(m["adam"] for m in mine) < 8 * 2 * 4, (rank, mine)
        assert all(m["adam"] + 4 * m["steps"] <= rank.optimizer for m in mine), (rank, mine)
