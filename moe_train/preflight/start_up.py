"""This process's start-up checks, before anything is allocated or written: the dispatcher that can
run here, the process group and layout (training's start_distributed, generation's
start_expert_parallel), the files the run reads, and what this machine refuses (refuse_at_start_up;
the launcher runs the same through `moe_train.preflight.launch_info`).
"""
from __future__ import annotations

import os

from moe_train.checkpoint.dcp import CheckpointError, resolve_resume
from moe_train.config import NATIVE_ALTERNATIVES, Config, ConfigError
from moe_train.data.blend import parse_blend
from moe_train.data.indexed_dataset import bin_path, idx_path
from moe_train.memory_snapshot import memory_snapshot_problem
from moe_train.metrics import wandb_module
from moe_train.preflight.layout import batch_problems
from moe_train.preflight.memory_limits import available_memory
from moe_train.preflight.pipeline import check_pipeline
from moe_train.preflight.plan import start_up_memory_problems
from moe_train.runtime import device_type, select_device
from parallel.dispatch import deepep_unavailable, native_unavailable
from parallel.topology import Topology, TopologyError, init_distributed


def choose_dispatcher(config: Config, topology: Topology | None) -> str:
    """`parallel.dispatcher` with `auto` resolved (never to `native`); a ConfigError where `native` cannot run
    in this process (the config alone cannot tell: the same file serves login nodes and GPU nodes)."""
    name = config.parallel.dispatcher
    if name == "native":
        problem = native_unavailable(across_nodes=topology is not None and topology.ep_nodes > 1,
                                     device=device_type(config.train))
        if problem is not None:
            raise ConfigError([("parallel.dispatcher", f"'native' cannot run here: {problem}; {NATIVE_ALTERNATIVES}")])
    if name == "deepep":
        ep, per_node = (1, 1) if topology is None else (topology.ep, topology.ep_ranks_per_node)
        problem = deepep_unavailable(device_type(config.train), ep, per_node)
        if problem is not None:
            raise ConfigError([("parallel.dispatcher", f"'deepep' cannot run here: {problem}; or use 'native', "
                                                       f"{NATIVE_ALTERNATIVES}")])
    if name != "auto":
        return name
    if topology is None or topology.ep == 1:
        return "local"
    return "hierarchical" if topology.ep_nodes > 1 else "alltoall"


def start_distributed(config: Config) -> Topology | None:
    """The process layout when launched with several processes (torchrun or srun), else None."""
    if launched_processes() <= 1:
        if config.parallel.ep > 1 or config.parallel.pp > 1:
            raise ConfigError([("parallel", f"ep={config.parallel.ep} x pp={config.parallel.pp} needs several "
                                            "processes; launch with NPROC_PER_NODE or under Slurm")])
        problems = batch_problems(config, 1)
        if problems:
            raise ConfigError(problems)
        return None
    p = config.parallel
    try:
        topology = init_distributed(p.pp, p.ep, gpus_per_node=p.gpus_per_node, timeout_s=p.timeout_s,
                                    num_experts=config.model.num_moe_experts)
    except TopologyError as err:
        raise ConfigError(err.problems) from None
    problems = batch_problems(config, topology.world_size)
    if problems:
        raise ConfigError(problems)
    if p.pp > 1:
        check_pipeline(config, topology.dp)
    return topology


def launched_processes() -> int:
    """The processes torchrun or srun started (1 without either)."""
    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))


def start_expert_parallel(config: Config) -> Topology | None:
    """Generation's layout: the EP group spanning every process when launched with several (torchrun
    or srun), else None."""
    world = launched_processes()
    p = config.parallel
    if p.pp != 1:
        raise ConfigError([("parallel.pp", f"generation runs without pipeline stages, got {p.pp}")])
    if p.ep != world:
        raise ConfigError([("parallel.ep", f"generation spreads the experts over all {world} process(es): set "
                                           f"parallel.ep={world}, got {p.ep}")])
    if world == 1:
        return None
    try:
        return init_distributed(1, p.ep, gpus_per_node=p.gpus_per_node, timeout_s=p.timeout_s,
                                num_experts=config.model.num_moe_experts)
    except TopologyError as err:
        raise ConfigError(err.problems) from None


def input_problems(config: Config) -> list[tuple[str, str]]:
    """The files the run reads that are missing or unusable, checked without reading them: each data
    prefix's .bin and .idx, a tokenizer.json, and the checkpoint a `checkpoint.resume` path selects."""
    problems = []
    d = config.data
    for key in ("path", "valid_path"):
        spec = getattr(d, key)
        for _, prefix in parse_blend(spec) if spec is not None else []:
            missing = [path for path in (idx_path(prefix), bin_path(prefix)) if not os.path.isfile(path)]
            if missing:
                problems.append((f"data.{key}", f"dataset file not found: {', '.join(missing)}"))
    if d.tokenizer != "byte" and not os.path.isfile(d.tokenizer):
        problems.append(("data.tokenizer", f"{d.tokenizer} is not a file (give 'byte' or a tokenizer.json)"))
    if config.checkpoint.resume not in ("auto", "none"):  # (auto's latest file is the run directory's: claim_run_dir)
        try:
            resolve_resume(config.checkpoint.resume, config.checkpoint_dir)
        except CheckpointError as err:
            problems.append(("checkpoint.resume", str(err).removeprefix("checkpoint.resume: ")))
    return problems


def refuse_at_start_up(config: Config, topology: Topology | None, processes_here: int) -> None:
    """What this machine refuses of `config` before anything is allocated or written, as a ConfigError:
    a wandb project without the package, more `train.threads` than CPUs (torch crashes on thousands),
    `train.device=cuda` without CUDA, `logging.memory_snapshot` off CUDA, a dispatcher that cannot run, inputs
    that are not there (input_problems), and a model or batch that cannot fit the memory one of `processes_here` local processes may use
    (moe_train.preflight.memory_limits). The launcher runs the same checks once, before it starts any process
    (moe_train.preflight.launch_info); a process group is not needed, only the layout."""
    if config.logging.wandb_project is not None and wandb_module() is None:
        raise ConfigError([("logging.wandb_project", f"is {config.logging.wandb_project!r}, but the wandb package "
                                                     "is not installed: pip install wandb, or unset the key")])
    problems = input_problems(config)
    if problems:
        raise ConfigError(problems)
    cpus = len(os.sched_getaffinity(0))
    if config.train.threads is not None and config.train.threads > cpus:
        raise ConfigError([("train.threads", f"{config.train.threads} exceeds the {cpus} CPUs this process may use")])
    device = select_device(config.train)
    snapshot_problem = memory_snapshot_problem(device.type) if config.logging.memory_snapshot else None
    if snapshot_problem is not None:
        raise ConfigError([("logging.memory_snapshot", snapshot_problem)])
    choose_dispatcher(config, topology)
    world = topology.world_size if topology is not None else 1
    problems = start_up_memory_problems(config, world, available_memory(device, processes_here), f"{device.type} memory")
    if problems:
        raise ConfigError(problems)
