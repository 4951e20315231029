"""Multi-process runs through the launcher's torchrun (moe_train.launch.torchrun): a dp x ep run on simulated
nodes, start-up refusals passed on as the workers' exit status, and a rank dying mid-run."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def torchrun(run_dir: Path, cache_dir: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "moe_train.launch.torchrun", "--standalone", "--nproc-per-node", "4",
            "-m", "moe_train.train", "--config", "moe_train/configs/tiny.yaml"]
    for kv in (f"logging.dir={run_dir}", f"data.cache_dir={cache_dir}", "data.demo_max_bytes=300000",
               "logging.tensorboard=false", "parallel.ep=4", "parallel.gpus_per_node=2", "parallel.timeout_s=30",
               "train.threads=1", "train.micro_batch_size=2", *extra):
        args += ["--set", kv]
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_bad_batch_split_is_refused_before_work(tmp_path):
    proc = torchrun(tmp_path / "run", tmp_path / "cache", "train.micro_batch_size=4")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out[-3000:]  # the workers' status, not torchrun's 1
    assert "train.global_batch_size: 8 is not a multiple of train.micro_batch_size=4 x dp=4" in out
    assert "Traceback" not in out and "ChildFailedError" not in out and "failed (exitcode" not in out, out[-3000:]


def test_four_processes_two_simulated_nodes(tmp_path):
    proc = torchrun(tmp_path / "run", tmp_path / "cache", "train.steps=3", "train.log_interval=1")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "layout: 4 processes = pp 1 x dp 4 (ep 4 inside dp), 2 per node" in out
    assert "routing is group-limited only" in out and "model.moe_router_num_groups=2" in out
    assert [r["step"] for r in records(tmp_path / "run")] == [1, 2, 3]
    assert (tmp_path / "run" / "checkpoints" / "iter_0000003").is_dir()


def test_a_dead_rank_stops_every_rank_and_is_named(tmp_path):
    run = tmp_path / "run"
    proc = torchrun(run, tmp_path / "cache", "train.steps=100000", "train.log_interval=1")
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not records(run):
            time.sleep(0.1)
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(workers) == 4
        victim = workers[2]
        environ = Path(f"/proc/{victim}/environ").read_bytes().split(b"\0")
        rank = next(e.split(b"=")[1].decode() for e in environ if e.startswith(b"RANK="))
        os.kill(int(victim), signal.SIGKILL)
        start = time.time()
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 1, out[-3000:]
        assert time.time() - start < 90
        assert f"error: worker rank {rank} (local rank {rank}, pid {victim}) was killed by SIGKILL" in out, out[-3000:]
        survivors = [r for r in range(4) if r != int(rank)]
        for survivor in survivors:  # each names itself and the failure, then its status passes on
            assert f"error: rank {survivor}: a collective failed in step " in out, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        assert not subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True).stdout
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_locked_run_dir_stops_every_rank_with_one_line(tmp_path):
    """Rank 0 finds logging.dir held (here by this test process); every rank learns it and exits 2."""
    from moe_train.launch.run_dir import lock_run_dir

    run = tmp_path / "run"
    lock = lock_run_dir(run)
    try:
        proc = torchrun(run, tmp_path / "cache", "train.steps=3")
        out, _ = proc.communicate(timeout=300)
    finally:
        lock.release()
    assert proc.returncode == 2, out[-3000:]
    assert out.count(f"error: logging.dir: {run} is in use by another run (pid {os.getpid()} on ") == 1, out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out and "failed (exitcode" not in out, out[-3000:]
    assert not (run / "metrics.jsonl").exists()


def test_a_worker_the_system_refuses_to_start_leaves_no_orphan(tmp_path):
    """fork fails for the third of 4 workers (EAGAIN, as under memory or process limits): one line, exit 1,
    and the two workers already started are stopped (torchrun left them waiting 60 s for the rendezvous)."""
    run = tmp_path / "run"
    script = """
import sys
import torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler as handler
from moe_train.launch import torchrun
real, started = handler.Popen, []
def popen(*args, **kwargs):
    if len(started) == 2:
        raise BlockingIOError(11, "Resource temporarily unavailable")
    started.append(real(*args, **kwargs))
    return started[-1]
handler.Popen = popen
torchrun.main(sys.argv[1:])
"""
    args = [sys.executable, "-c", script, "--standalone", "--nproc-per-node", "4", "-m", "moe_train.train",
            "--config", "moe_train/configs/tiny.yaml", "--set", f"logging.dir={run}", "--set", "train.micro_batch_size=2"]
    proc = subprocess.run(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert ("error: the workers could not be started: [Errno 11] Resource temporarily unavailable; the ones already "
            "started were stopped") in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    time.sleep(1)
    orphans = subprocess.run(["pgrep", "-f", f"logging.dir={run}"], capture_output=True, text=True).stdout.split()
    assert not orphans, f"workers left running: {orphans}"
