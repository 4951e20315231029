"""Rank layout and group lists against hand-written layouts; validation; launcher environments."""
import pytest
import torch.distributed as dist

from parallel.topology import (
    GROUP_KINDS,
    Topology,
    TopologyError,
    first_slurm_host,
    group_ranks,
    init_distributed,
    read_launch_env,
    routing_statement,
    validate_layout,
)

SINGLETONS8 = [[r] for r in range(8)]

LAYOUTS = {
    # 8 ranks, ep 4 over 2 nodes of 2: two EP groups, each on two nodes
    (8, 1, 4, 2): dict(
        pp=SINGLETONS8, dp=[list(range(8))], ep=[[0, 1, 2, 3], [4, 5, 6, 7]],
        expert_dp=[[0, 4], [1, 5], [2, 6], [3, 7]], intra_node=[[0, 1], [2, 3], [4, 5], [6, 7]],
        rail=[[0, 2], [1, 3], [4, 6], [5, 7]]),
    # 16 ranks, pp 2, ep 4 inside nodes of 8: no rail traffic (rails are single ranks)
    (16, 2, 4, 8): dict(
        pp=[[d, d + 8] for d in range(8)], dp=[list(range(8)), list(range(8, 16))],
        ep=[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        expert_dp=[[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
        intra_node=[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        rail=[[r] for r in range(16)]),
    # 16 ranks, pp 2, ep = dp = 8 over 2 nodes of 4: expert-dp is trivial
    (16, 2, 8, 4): dict(
        pp=[[d, d + 8] for d in range(8)], dp=[list(range(8)), list(range(8, 16))],
        ep=[list(range(8)), list(range(8, 16))], expert_dp=[[r] for r in range(16)],
        intra_node=[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        rail=[[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]),
    # 8 ranks, pp 2, ep 2, one rank per node: every EP pair crosses nodes
    (8, 2, 2, 1): dict(
        pp=[[0, 4], [1, 5], [2, 6], [3, 7]], dp=[[0, 1, 2, 3], [4, 5, 6, 7]],
        ep=[[0, 1], [2, 3], [4, 5], [6, 7]], expert_dp=[[0, 2], [1, 3], [4, 6], [5, 7]],
        intra_node=SINGLETONS8, rail=[[0, 1], [2, 3], [4, 5], [6, 7]]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda k: "world{}-pp{}-ep{}-gpn{}".format(*k))
def test_group_lists_match_hand_written_layouts(layout):
    groups = group_ranks(*layout)
    for kind in GROUP_KINDS:
        assert getattr(groups, kind) == LAYOUTS[layout][kind], kind


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda k: "world{}-pp{}-ep{}-gpn{}".format(*k))
def test_rank_coordinates_agree_with_groups(layout):
    world, pp, ep, gpn = layout
    groups = group_ranks(*layout)
    for rank in range(world):
        topo = Topology(rank, world, pp, ep, gpn)
        assert groups.containing("pp", rank).index(rank) == topo.pp_rank
        assert groups.containing("dp", rank).index(rank) == topo.dp_rank
        assert groups.containing("ep", rank).index(rank) == topo.ep_rank
        assert groups.containing("expert_dp", rank).index(rank) == topo.expert_dp_rank
        assert groups.containing("intra_node", rank).index(rank) == topo.local_rank % topo.ep_ranks_per_node
        assert groups.containing("rail", rank).index(rank) == (topo.ep_rank // topo.ep_ranks_per_node)
        assert {r // gpn for r in groups.containing("intra_node", rank)} == {topo.node}
        assert len(groups.containing("rail", rank)) == topo.ep_nodes
        assert topo.dp * pp == world and topo.expert_dp * ep == topo.dp


@pytest.mark.parametrize("args,key,fragment", [
    (dict(world_size=6, pp=4, ep=1, gpus_per_node=6), "parallel.pp", "not divisible by pp=4"),
    (dict(world_size=8, pp=2, ep=3, gpus_per_node=1), "parallel.ep", "pp x ep = 6"),
    (dict(world_size=8, pp=1, ep=4, gpus_per_node=8, num_experts=10), "parallel.ep", "num_moe_experts=10"),
    (dict(world_size=8, pp=1, ep=8, gpus_per_node=3), "parallel.gpus_per_node", "whole number of nodes"),
    (dict(world_size=12, pp=1, ep=6, gpus_per_node=4), "parallel.gpus_per_node", "span whole nodes"),
    (dict(world_size=8, pp=1, ep=0, gpus_per_node=8), "parallel.ep", ">= 1"),
])
def test_validation_names_the_key(args, key, fragment):
    with pytest.raises(TopologyError) as info:
        validate_layout(**args)
    assert {k for k, _ in info.value.problems} == {key}
    assert fragment in str(info.value) and isinstance(info.value, ValueError)


def test_init_validates_before_starting_any_process_group():
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    with pytest.raises(TopologyError, match="parallel.pp"):
        init_distributed(pp=3, ep=1, environ=env)
    with pytest.raises(TopologyError, match="parallel.gpus_per_node"):
        init_distributed(pp=1, ep=4, gpus_per_node=3, environ=env)
    with pytest.raises(TopologyError, match="num_moe_experts=6"):
        init_distributed(pp=1, ep=4, num_experts=6, environ=env)
    assert not dist.is_initialized()


def test_torchrun_environment_wins_over_slurm():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "head", "MASTER_PORT": "2345", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    launch = read_launch_env(env)
    assert (launch.source, launch.rank, launch.world_size, launch.local_rank, launch.local_world_size,
            launch.master_addr, launch.master_port) == ("torchrun", 5, 8, 1, 4, "head", 2345)


def test_slurm_environment():
    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "10", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_TASKS_PER_NODE": "4(x2),2", "SLURM_JOB_NODELIST": "gpu[003-005,9],cpu1", "SLURM_JOB_ID": "77"}
    launch = read_launch_env(env)
    assert (launch.source, launch.rank, launch.world_size, launch.local_rank, launch.local_world_size,
            launch.master_addr, launch.master_port) == ("slurm", 9, 10, 1, 2, "gpu003", 29577)
    assert read_launch_env({**env, "SLURM_NTASKS_PER_NODE": "4"}).local_world_size == 4
    assert first_slurm_host("hostA,hostB") == "hostA"


def test_missing_or_bad_launch_variables_are_named():
    with pytest.raises(TopologyError, match="WORLD_SIZE"):
        read_launch_env({"RANK": "0"})
    with pytest.raises(TopologyError, match="SLURM_NTASKS: expected an integer"):
        read_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "x", "MASTER_ADDR": "h"})
    assert read_launch_env({}).source == "single"


def test_routing_statement():
    dsv3 = routing_statement(ep=64, gpus_per_node=8, num_groups=8, group_topk=4, topk=8)
    assert dsv3.startswith("routing is node-limited") and "at most 4 nodes" in dsv3
    coarse = routing_statement(ep=64, gpus_per_node=8, num_groups=4, group_topk=2, topk=8)
    assert coarse.startswith("routing is group-limited only") and "reach 4 nodes" in coarse
    assert "moe_router_num_groups=8" in coarse
    fine = routing_statement(ep=32, gpus_per_node=8, num_groups=8, group_topk=2, topk=8)
    assert "group-limited only" in fine and "reach 2 nodes" in fine
    assert "fits in one node" in routing_statement(ep=4, gpus_per_node=8, num_groups=4, group_topk=2, topk=2)
