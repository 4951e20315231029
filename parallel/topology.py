"""Process layout: ranks -> (pp, dp, ep, node, local rank), and the process groups of a run.

Megatron order, innermost first: ep, then dp (ep is carved out of dp), pp outermost. With
`world = pp * dp`, rank r sits in pipeline stage `r // dp`, at data-parallel index `r % dp`, and
at expert-parallel index `r % ep`; the expert-data-parallel group joins the ranks of one stage
that hold the same experts (size dp / ep). Nodes are blocks of `gpus_per_node` consecutive ranks
(default: the launcher's local world size; smaller values simulate several nodes on one CPU
machine). An EP group either fits inside one node or spans whole nodes; inside it, the
intra-node group holds the EP ranks of one node and the rail group the EP ranks with the same
local rank on each of its nodes (the two hops of the hierarchical dispatcher).

`group_ranks` computes every group's rank lists without processes; `init_distributed` reads the
torchrun or Slurm environment, validates the layout before any work, starts the default process
group (NCCL on CUDA, gloo on CPU) and builds the subgroups, every one with the same timeout.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

GROUP_KINDS = ("pp", "dp", "ep", "expert_dp", "intra_node", "rail")


class TopologyError(ValueError):
    """Impossible process layout, each problem as (key, message) with the config or env key."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("\n".join(f"{key}: {message}" for key, message in problems))


def layout_problems(world_size: int, pp: int, ep: int, gpus_per_node: int,
                    num_experts: int | None = None) -> list[tuple[str, str]]:
    """Every reason why (world, pp, ep, gpus_per_node[, experts]) cannot be laid out; empty if fine."""
    problems = []
    for key, value in (("WORLD_SIZE", world_size), ("parallel.pp", pp), ("parallel.ep", ep),
                       ("parallel.gpus_per_node", gpus_per_node)):
        if value < 1:
            problems.append((key, f"must be >= 1, got {value}"))
    if problems:
        return problems
    if world_size % pp:
        problems.append(("parallel.pp", f"world size {world_size} is not divisible by pp={pp}"))
    elif (world_size // pp) % ep:
        problems.append(("parallel.ep", f"ep={ep} does not divide the data-parallel size "
                                        f"{world_size // pp} (world size {world_size} / pp={pp}); "
                                        f"world size must be a multiple of pp x ep = {pp * ep}"))
    if num_experts is not None and num_experts % ep:
        problems.append(("parallel.ep", f"num_moe_experts={num_experts} is not divisible by ep={ep}"))
    if world_size % gpus_per_node:
        problems.append(("parallel.gpus_per_node",
                         f"world size {world_size} is not a whole number of nodes of {gpus_per_node} ranks"))
    if ep % gpus_per_node and gpus_per_node % ep:
        problems.append(("parallel.gpus_per_node",
                         f"an EP group of {ep} ranks must fit inside one node of {gpus_per_node} ranks "
                         f"or span whole nodes"))
    return problems


def validate_layout(world_size: int, pp: int, ep: int, gpus_per_node: int,
                    num_experts: int | None = None) -> None:
    problems = layout_problems(world_size, pp, ep, gpus_per_node, num_experts)
    if problems:
        raise TopologyError(problems)


@dataclass(frozen=True)
class GroupRanks:
    """The rank lists of every group kind; each kind partitions the world."""

    pp: list[list[int]]
    dp: list[list[int]]
    ep: list[list[int]]
    expert_dp: list[list[int]]
    intra_node: list[list[int]]
    rail: list[list[int]]

    def containing(self, kind: str, rank: int) -> list[int]:
        return next(ranks for ranks in getattr(self, kind) if rank in ranks)


def group_ranks(world_size: int, pp: int, ep: int, gpus_per_node: int) -> GroupRanks:
    """All group rank lists for a layout (validated first), in Megatron order."""
    validate_layout(world_size, pp, ep, gpus_per_node)
    dp = world_size // pp
    per_node = min(ep, gpus_per_node)
    ep_groups = [list(range(start, start + ep)) for start in range(0, world_size, ep)]
    return GroupRanks(
        pp=[list(range(d, world_size, dp)) for d in range(dp)],
        dp=[list(range(s * dp, (s + 1) * dp)) for s in range(pp)],
        ep=ep_groups,
        expert_dp=[list(range(s * dp + e, (s + 1) * dp, ep)) for s in range(pp) for e in range(ep)],
        intra_node=[group[i:i + per_node] for group in ep_groups for i in range(0, ep, per_node)],
        rail=[group[local::per_node] for group in ep_groups for local in range(per_node)],
    )


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits, as told by the launcher."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "single"


def _int_env(environ: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = environ.get(key)
    if raw is None:
        if default is None:
            raise TopologyError([(key, "is not set")])
        return default
    try:
        return int(raw)
    except ValueError:
        raise TopologyError([(key, f"expected an integer, got {raw!r}")]) from None


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list: 'gpu[003-005,9],cpu1' -> 'gpu003'."""
    match = re.match(r"([^,\[]+)(?:\[([^,\-\]]+))?", nodelist)
    if match is None:
        raise TopologyError([("SLURM_JOB_NODELIST", f"cannot read a host name from {nodelist!r}")])
    return match.group(1) + (match.group(2) or "")


def slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks on node `node_id` from SLURM_TASKS_PER_NODE, e.g. '4(x2),2' -> [4, 4, 2]."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise TopologyError([("SLURM_TASKS_PER_NODE", f"cannot parse {tasks_per_node!r}")])
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise TopologyError([("SLURM_NODEID", f"node {node_id} is not in SLURM_TASKS_PER_NODE={tasks_per_node!r}")])
    return counts[node_id]


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """torchrun variables when present, else Slurm's (one task per rank), else a single process."""
    env = os.environ if environ is None else environ
    if "RANK" in env:
        return LaunchEnv(
            rank=_int_env(env, "RANK"), world_size=_int_env(env, "WORLD_SIZE"),
            local_rank=_int_env(env, "LOCAL_RANK", 0),
            local_world_size=_int_env(env, "LOCAL_WORLD_SIZE", _int_env(env, "WORLD_SIZE")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=_int_env(env, "MASTER_PORT", 29500),
            source="torchrun")
    if "SLURM_PROCID" in env:
        if "MASTER_ADDR" in env:
            addr = env["MASTER_ADDR"]
        elif "SLURM_JOB_NODELIST" in env:
            addr = first_slurm_host(env["SLURM_JOB_NODELIST"])
        else:
            raise TopologyError([("MASTER_ADDR", "not set, and SLURM_JOB_NODELIST is missing to derive it")])
        if "SLURM_NTASKS_PER_NODE" in env:
            local_world = _int_env(env, "SLURM_NTASKS_PER_NODE")
        elif "SLURM_TASKS_PER_NODE" in env:
            local_world = slurm_tasks_on_node(env["SLURM_TASKS_PER_NODE"], _int_env(env, "SLURM_NODEID", 0))
        else:
            local_world = _int_env(env, "SLURM_NTASKS")
        return LaunchEnv(
            rank=_int_env(env, "SLURM_PROCID"), world_size=_int_env(env, "SLURM_NTASKS"),
            local_rank=_int_env(env, "SLURM_LOCALID", 0), local_world_size=local_world,
            master_addr=addr,
            master_port=_int_env(env, "MASTER_PORT", 29500 + _int_env(env, "SLURM_JOB_ID", 0) % 20000),
            source="slurm")
    return LaunchEnv(0, 1, 0, 1, "127.0.0.1", 29500, "single")


@dataclass
class Topology:
    """This rank's coordinates in the layout, and (once built) its process groups."""

    rank: int
    world_size: int
    pp: int
    ep: int
    gpus_per_node: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        validate_layout(self.world_size, self.pp, self.ep, self.gpus_per_node)

    @property
    def dp(self) -> int:
        return self.world_size // self.pp

    @property
    def expert_dp(self) -> int:
        return self.dp // self.ep

    @property
    def pp_rank(self) -> int:
        return self.rank // self.dp

    @property
    def dp_rank(self) -> int:
        return self.rank % self.dp

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    @property
    def expert_dp_rank(self) -> int:
        return self.dp_rank // self.ep

    @property
    def node(self) -> int:
        return self.rank // self.gpus_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.gpus_per_node

    @property
    def ep_ranks_per_node(self) -> int:
        return min(self.ep, self.gpus_per_node)

    @property
    def ep_nodes(self) -> int:
        """Nodes an EP group spans (1 when it fits inside one node)."""
        return self.ep // self.ep_ranks_per_node

    def ranks(self, kind: str) -> list[int]:
        """Global ranks of this rank's group of `kind` (one of GROUP_KINDS)."""
        return group_ranks(self.world_size, self.pp, self.ep, self.gpus_per_node).containing(kind, self.rank)

    def group(self, kind: str) -> dist.ProcessGroup:
        """This rank's process group of `kind` (one of GROUP_KINDS)."""
        if kind not in self.groups:
            raise RuntimeError(f"no {kind!r} process group: build the topology with build_topology()")
        return self.groups[kind]

    def destroy_groups(self) -> None:
        """Destroy this topology's subgroups (not the default group)."""
        for group in {id(g): g for g in self.groups.values()}.values():
            dist.destroy_process_group(group)
        self.groups.clear()

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size}: pp {self.pp_rank}/{self.pp}, dp {self.dp_rank}/{self.dp}, "
                f"ep {self.ep_rank}/{self.ep}, expert-dp {self.expert_dp_rank}/{self.expert_dp}, "
                f"node {self.node} local rank {self.local_rank} ({self.gpus_per_node} per node)")


def build_topology(pp: int, ep: int, gpus_per_node: int, timeout_s: float,
                   device: torch.device | None = None) -> Topology:
    """Topology of this rank with all subgroups created; needs an initialised default group.

    Every rank must call this (group creation is collective), in the same order as other group
    creations. Groups get `timeout_s`, so a collective that a peer never joins fails instead of
    hanging.
    """
    topology = Topology(dist.get_rank(), dist.get_world_size(), pp, ep, gpus_per_node,
                        device or torch.device("cpu"))
    lists = group_ranks(topology.world_size, pp, ep, gpus_per_node)
    timeout = timedelta(seconds=timeout_s)
    for kind in GROUP_KINDS:
        for ranks in getattr(lists, kind):
            group = dist.new_group(ranks, timeout=timeout)
            if topology.rank in ranks:
                topology.groups[kind] = group
    return topology


def init_distributed(pp: int, ep: int, *, gpus_per_node: int | None = None, timeout_s: float = 300.0,
                     num_experts: int | None = None, environ: Mapping[str, str] | None = None) -> Topology:
    """Read the launcher's environment, validate, start the default group and build the subgroups."""
    launch = read_launch_env(environ)
    per_node = gpus_per_node or launch.local_world_size
    validate_layout(launch.world_size, pp, ep, per_node, num_experts)
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", launch.local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
                                rank=launch.rank, world_size=launch.world_size,
                                timeout=timedelta(seconds=timeout_s))
    return build_topology(pp, ep, per_node, timeout_s, device)


def max_nodes_per_token(ep_nodes: int, num_groups: int, group_topk: int, topk: int) -> int:
    """Most nodes of an EP group one token can reach under group-limited routing."""
    if num_groups <= 1:
        return min(ep_nodes, topk)
    if num_groups % ep_nodes == 0:  # groups nest inside nodes
        return min(ep_nodes, group_topk, topk)
    if ep_nodes % num_groups == 0:  # a group spans several whole nodes
        return min(ep_nodes, group_topk * (ep_nodes // num_groups), topk)
    return min(ep_nodes, topk)


def routing_statement(ep: int, gpus_per_node: int, num_groups: int, group_topk: int, topk: int) -> str:
    """The one-line start-up statement: is routing node-limited for this layout?

    Experts are placed contiguously by global id, so router group g is node g of an EP group
    exactly when the number of groups equals the number of nodes the EP group spans.
    """
    nodes = max(1, ep // gpus_per_node)
    if nodes == 1:
        return (f"routing: the EP group ({ep} ranks) fits in one node, all dispatch traffic is intra-node "
                f"({num_groups} router groups, keep {group_topk})")
    reach = max_nodes_per_token(nodes, num_groups, group_topk, topk)
    if num_groups == nodes:
        return (f"routing is node-limited: {num_groups} router groups = the {nodes} nodes of an EP group "
                f"(experts contiguous by id), each token reaches at most {reach} node{'s' * (reach != 1)}")
    return (f"routing is group-limited only: {num_groups} router groups do not map onto the {nodes} nodes "
            f"of an EP group, a token may reach {reach} node{'s' * (reach != 1)} "
            f"(set model.moe_router_num_groups={nodes} for node-limited routing)")
