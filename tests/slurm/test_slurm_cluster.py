"""A real two-node Slurm cluster on this machine (scripts/slurm_local_cluster.sh): a batch job across
both nodes, gloo across nodes with torchrun under srun, and the training launcher: submitted with
sbatch from another directory, resubmitted to resume from the first job's checkpoint, and run
inside salloc. Every failure shows the job's output.

Needs root; skipped only when Slurm is missing and cannot be installed (exit status 3 of the harness).
Jobs are waited for by polling `scontrol show job` every 0.5 s: `sbatch --wait` sleeps 2 s, then
8 s, then 32 s between its own checks, which would cost ~10 s per job here.
"""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HARNESS = str(REPO / "scripts" / "slurm_local_cluster.sh")
pytestmark = pytest.mark.slow
PENDING_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED"}

ALL_REDUCE = """\
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([rank + 1.0])
dist.all_reduce(value)
ok = value.item() == world * (world + 1) / 2
print(f"rank={rank}/{world} node={os.environ['SLURMD_NODENAME']} ok={ok}", flush=True)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def cluster():
    """Starts the cluster unless it already runs (e.g. started by .ci/run), and stops it only if it
    was started here."""
    was_running = subprocess.run([HARNESS, "status"], capture_output=True).returncode == 0
    start = subprocess.run([HARNESS, "start"], capture_output=True, text=True, timeout=300)
    if start.returncode != 0:
        if not was_running:
            subprocess.run([HARNESS, "stop"], timeout=120)
        if start.returncode == 3:
            pytest.skip(f"local Slurm cluster unavailable: {start.stderr.strip()}")
        pytest.fail(f"{HARNESS} start failed:\n{start.stdout}{start.stderr}")
    yield
    if not was_running:
        subprocess.run([HARNESS, "stop"], check=True, timeout=120)


def run_job(args: list[str], output: Path, env: dict | None = None, timeout: float = 60.0,
            cwd: Path = REPO) -> tuple[str, str, str]:
    """Submits `sbatch args` from `cwd` and waits for the job to end; returns its id, its final state
    and its output file."""
    submit = subprocess.run(["sbatch", "--parsable", "--time=3", f"--output={output}", *args], cwd=cwd,
                            env=env, capture_output=True, text=True, check=True)
    job_id = submit.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    while True:
        info = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                              check=True).stdout
        state = re.search(r"JobState=(\S+)", info).group(1)
        if state not in PENDING_STATES:
            return job_id, state, output.read_text() if output.exists() else "<no output file>"
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id])
            text = output.read_text() if output.exists() else "<no output file>"
            pytest.fail(f"job {job_id} still {state} after {timeout:.0f} s; output:\n{text}")
        time.sleep(0.5)


def test_both_nodes_idle(cluster):
    states = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True,
                            check=True).stdout.split()
    assert dict(zip(states[::2], states[1::2])) == {"n1": "idle", "n2": "idle"}


def test_batch_job_spans_two_nodes(cluster, tmp_path):
    script = tmp_path / "hello.sh"
    script.write_text('#!/bin/bash\nsrun bash -c \'echo "nodeid=$SLURM_NODEID host=$(hostname)"\'\n')
    _, state, text = run_job(["--nodes=2", "--ntasks-per-node=1", str(script)], tmp_path / "hello.out")
    assert state == "COMPLETED", f"job {state}; output:\n{text}"
    host = os.uname().nodename
    assert sorted(re.findall(r"nodeid=\d+ host=\S+", text)) == [f"nodeid=0 host={host}",
                                                                 f"nodeid=1 host={host}"], text


def test_gloo_all_reduce_with_torchrun_under_srun(cluster, tmp_path):
    (tmp_path / "all_reduce.py").write_text(ALL_REDUCE)
    # The reference pattern: one torchrun agent per node, c10d rendezvous on the first node, a
    # port derived from the job id so concurrent jobs on the shared kernel do not collide.
    script = tmp_path / "gloo.sh"
    script.write_text(f"""#!/bin/bash
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun --kill-on-bad-exit=1 {sys.executable} -m torch.distributed.run --nnodes "$SLURM_NNODES" \\
    --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint "$head:$((20000 + SLURM_JOB_ID % 20000))" \\
    --rdzv-id "$SLURM_JOB_ID" {tmp_path / "all_reduce.py"}
""")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    _, state, text = run_job(["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2", str(script)],
                          tmp_path / "gloo.out", env=env, timeout=120)
    assert state == "COMPLETED", f"job {state}; output:\n{text}"
    lines = sorted(re.findall(r"rank=\d/4 node=n\d ok=True", text))
    assert len(lines) == 4 and {line.split()[1] for line in lines} == {"node=n1", "node=n2"}, text


def launcher_env(nproc_per_node: int = 1) -> dict:
    return {**os.environ, "NPROC_PER_NODE": str(nproc_per_node), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}


def train_args(steps: int, run_dir: Path | str) -> list[str]:
    return ["--set", f"train.steps={steps}", "--set", "train.log_interval=1", "--set", f"logging.dir={run_dir}"]


def logged_steps(run_dir: Path, text: str) -> list[int]:
    metrics = run_dir / "metrics.jsonl"
    assert metrics.exists(), f"no metrics written; output:\n{text}"
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"step"' in line]


def test_launcher_submitted_from_another_directory(cluster, tmp_path):
    """The config path is relative to the repository and logging.dir to the submit directory."""
    job_id, state, text = run_job(["--nodes=1", str(REPO / "scripts" / "pretrain_dsv3.sh"), "moe_train/configs/tiny.yaml",
                                   *train_args(2, "run")], tmp_path / "train.out", env=launcher_env(),
                                  timeout=150, cwd=tmp_path)
    assert state == "COMPLETED", f"job {state}; output:\n{text}"
    assert "1 node(s) x 1 process(es)" in text, text
    assert logged_steps(tmp_path / "run", text) == [1, 2]
    job_logs = tmp_path / "run" / f"slurm-{job_id}"
    assert "loss" in (job_logs / "output.log").read_text(), text
    assert "--config " + str(REPO / "moe_train" / "configs" / "tiny.yaml") in (job_logs / "launch.txt").read_text()


def test_second_submission_resumes_across_two_nodes(cluster, tmp_path):
    """2 nodes x 2 processes, expert parallelism over both nodes (hierarchical dispatch), resumed."""
    run_dir = tmp_path / "run"
    args = ["--nodes=2", "--ntasks-per-node=1", "scripts/pretrain_dsv3.sh", "moe_train/configs/tiny.yaml",
            "--set", "parallel.ep=4", "--set", "train.micro_batch_size=2"]
    first_id, state, text = run_job(args + train_args(2, run_dir), tmp_path / "first.out", env=launcher_env(2),
                                    timeout=150)
    assert state == "COMPLETED", f"job {state}; output:\n{text}"
    assert "2 node(s) x 2 process(es)" in text, text
    assert "layout: 4 processes = pp 1 x dp 4 (ep 4 inside dp), 2 per node" in text, text
    second_id, state, text = run_job(args + train_args(4, run_dir), tmp_path / "second.out", env=launcher_env(2),
                                     timeout=150)
    assert state == "COMPLETED", f"job {state}; output:\n{text}"
    assert "at step 2" in text and "resumed from" in text, text
    assert logged_steps(run_dir, text) == [1, 2, 3, 4]
    assert (run_dir / f"slurm-{first_id}" / "output.log").exists() and (run_dir / f"slurm-{second_id}").is_dir()


def test_launcher_inside_salloc(cluster, tmp_path):
    run_dir = tmp_path / "run"
    command = ["salloc", "--nodes=2", "--ntasks-per-node=1", "--time=3", "bash", "scripts/pretrain_dsv3.sh",
               "moe_train/configs/tiny.yaml", *train_args(2, run_dir)]
    try:
        result = subprocess.run(command, cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"salloc still running after 150 s; output:\n{err.stdout}{err.stderr}")
    text = result.stdout + result.stderr
    assert result.returncode == 0, f"salloc exited {result.returncode}; output:\n{text}"
    assert "2 node(s) x 1 process(es)" in text, text
    assert logged_steps(run_dir, text) == [1, 2]
