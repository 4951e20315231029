"""Greedy generation with the experts spread over 2 and 4 gloo processes equals one process: through
the worker pools (each rank holds and loads only its experts), and once through torchrun and the CLI."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_train.config import load_config
from moe_train.data.tokenizers import ByteTokenizer
from moe_train.generate.cli import Options, generate
from parallel.topology import build_topology
from tests.unit._tiny_checkpoint import ROOT, TINY, write_tiny_checkpoint

PROMPT = "The router sends each token"
OPTIONS = Options(PROMPT, max_new_tokens=12, temperature=0.0)


def greedy_ids(root: str, ep: int, *extra: str) -> list[int]:
    """On every rank of the pool (ep > 1), or in this process (ep 1)."""
    config = load_config(TINY, [f"parallel.ep={ep}", "parallel.timeout_s=60", *extra])
    topology = build_topology(pp=1, ep=ep, gpus_per_node=ep, timeout_s=60) if ep > 1 else None
    try:
        tokenizer = ByteTokenizer()
        folder = Path(root) / "iter_0000003"
        return generate(config, folder, tokenizer.encode(PROMPT), OPTIONS, tokenizer, topology)
    finally:
        if topology is not None:
            topology.destroy_groups()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate_ep") / "checkpoints"
    seed = random.randrange(2**31)
    print(f"tiny checkpoint: seed {seed}")
    write_tiny_checkpoint(root, seed)
    return root, greedy_ids(str(root), 1)


@pytest.mark.parametrize("ep", [2, 4])
def test_greedy_output_with_expert_parallel_equals_one_process(pools, checkpoint, ep):
    root, single = checkpoint
    assert pools.get(ep).run(greedy_ids, str(root), ep, deadline_s=180) == [single] * ep


def native_and_reference_bf16_ids(root: str, ep: int) -> tuple[list[int], list[int]]:
    """This rank's greedy ids decoded by the low-latency kernels (dispatcher native: kernels_cuda.Buffer,
    bfloat16 rows) and by the reference exchange with bfloat16 rows, prefill through the native kernels
    for both."""
    from moe_train.generate import cli
    from parallel.dispatch.comm import ProcessGroupComm
    from parallel.dispatch.low_latency import LowLatencyExchange
    from parallel.dispatch.low_latency_experts import LowLatencyExperts

    kernels_exchange, made = cli.decode_exchange, []
    try:
        cli.decode_exchange = lambda config, topology: made.append(kernels_exchange(config, topology)) or made[-1]
        native = greedy_ids(root, ep, "parallel.dispatcher=native", "parallel.comm_sms=4")
        assert [type(m.exchange).__name__ for m in made] == ["Buffer"], made
        cli.decode_exchange = lambda config, topology: LowLatencyExperts(
            LowLatencyExchange(ProcessGroupComm(topology.group("ep"))), config.model.num_moe_experts, 1, torch.bfloat16)
        reference = greedy_ids(root, ep, "parallel.dispatcher=native", "parallel.comm_sms=4")
    finally:
        cli.decode_exchange = kernels_exchange
    return native, reference


def test_decode_steps_through_the_low_latency_kernels_equal_the_reference(pools, kernels_cpu, checkpoint):
    root, _ = checkpoint
    results = pools.get(2).run(native_and_reference_bf16_ids, str(root), 2, deadline_s=240)
    native, reference = results[0]
    assert len(native) == OPTIONS.max_new_tokens or native[-1] == ByteTokenizer().eod_id
    assert all(r == (native, reference) for r in results) and native == reference


def test_torchrun_cli_with_two_expert_parallel_processes(checkpoint):
    root, single = checkpoint
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "moe_train.generate", "--config", str(TINY), "--checkpoint", str(root), "--prompt", PROMPT,
            "--max-new-tokens", "12", "--temperature", "0", "--json", "--set", "parallel.ep=2",
            "--set", "parallel.timeout_s=60"]
    res = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result["output_ids"] == single and res.stdout.count("output_ids") == 1  # rank 0 prints
