"""The README runs: every command of a ```bash block of README.md that trains, prepares data, plans
converts or generates is executed (steps reduced with --set) and must exit 0.

Each command line of every ```bash block (continuation lines ending in a backslash joined, comments
dropped) is either run here or listed in SKIPPED with the reason. A command that is neither fails
the test, so a new README command has to be made to run or be skipped on purpose.

Commands run in a fresh temporary directory that holds the README's placeholder inputs under
their README names (`my.yaml`, `corpus/`, `more.jsonl`, `path/to/tokenizer.json`); repository
paths (`scripts/...`, `moe_train/configs/...`) point into this checkout. Training commands get
`--set train.steps=2`, a fresh `logging.dir` (one run per directory, moe_train/launch/run_dir.py) unless they
name their own (a later command of the README reads that run's checkpoints) and a small demo corpus;
`torchrun` runs as `python -m torch.distributed.run`; generation commands read a tiny random checkpoint
written at the README's `runs/tiny/checkpoints` (fixed seed). No random seeds are drawn: the inputs are
fixed text and the runs use their
configs' train.seed.
"""
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

# Commands deliberately not run, by their text in README.md (whitespace and comments ignored).
SKIPPED = {
    'pip install torch==2.13.0 && pip install -e ".[test]"':
        "installs packages into the environment (needs the network); the suite runs in that environment",
    "python -m pytest tests -q":
        "the whole test suite, of which this test is a part",
    "sbatch --nodes 256 scripts/pretrain_dsv3.sh moe_train/configs/dsv3_671b.yaml [--set section.key=value ...]":
        "needs a 256-node GPU Slurm cluster; the launcher under sbatch is tested in tests/slurm",
    "salloc --nodes 2 bash scripts/pretrain_dsv3.sh moe_train/configs/tiny.yaml":
        "needs a Slurm allocation; tests/slurm runs this salloc on the local two-node cluster",
    "python -m kernels_cuda.build --device cpu":
        "builds the CPU emulation of the kernels (about 90 s); tests/kernels builds and uses it",
    "python -m pytest tests/kernels -q":
        "a test suite (tests/kernels), not a train, data, plan or convert command",
    "python -m kernels_cuda.build --device cpu --asan":
        "an AddressSanitizer build of the kernels (minutes), for the ASan kernel tests",
    'LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so)" '
    "ASAN_OPTIONS=detect_leaks=0 python -m pytest tests/kernels -q":
        "the kernel test suite under AddressSanitizer, not a train, data, plan or convert command",
}

# Appended to every training command (later --set overrides win).
TRAIN_REDUCTION = ["train.steps=2", "train.log_interval=1", "train.eval_interval=0",
                   "checkpoint.interval=0", "data.demo_max_bytes=200000"]

WORDS = ["def", "return", "expert", "router", "token", "loss", "layer", "pipeline", "stage", "batch"]


def normalize(command):
    """One spelling of a command line (comments dropped); quoting kept where a word needs it, so
    `--set "data.path=0.7 A 0.3 B"` is still one argument when the command is split again to run."""
    return shlex.join(shlex.split(command, comments=True))


def readme_commands(text):
    """Command lines of the ```bash blocks, continuations joined, comments and blank lines dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            if shlex.split(line, comments=True):
                commands.append(normalize(line))
    return commands


def classify(tokens):
    """'train', 'help' (prints and exits: --help, --print-config), 'data', 'plan', 'convert' or 'generate' for
    a runnable command (after its VAR=value prefix)."""
    words = tokens[next(i for i, t in enumerate(tokens) if not re.match(r"^[A-Z_][A-Z0-9_]*=", t)):]
    if words[:2] == ["bash", "scripts/pretrain_dsv3.sh"] or words[:3] == ["python", "-m", "moe_train.train"]:
        return "help" if {"--help", "--print-config"} & set(words) else "train"
    if words[:2] == ["python", "scripts/prepare_data.py"]:
        return "data"
    if words[:3] == ["python", "-m", "moe_train.plan"]:
        return "plan"
    if words[:3] == ["python", "-m", "moe_train.checkpoint.hf"] or (words[0] == "torchrun" and "moe_train.checkpoint.hf" in words):
        return "convert"
    if words[:3] == ["python", "-m", "moe_train.generate"] or (
            words[:3] == ["python", "-m", "torch.distributed.run"] and "moe_train.generate" in words):
        return "generate"
    return None


def make_inputs(work):
    """The README's placeholder inputs, under the names the README uses, in the working directory."""
    tiny = yaml.safe_load((REPO / "moe_train/configs/tiny.yaml").read_text())
    (work / "my.yaml").write_text(yaml.safe_dump(tiny))
    (work / "corpus").mkdir()
    for i in range(6):
        text = " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(800))
        (work / "corpus" / f"doc{i}.txt").write_text(text + "\n")
    (work / "more.jsonl").write_text("".join(
        '{"text": "%s"}\n' % " ".join(WORDS[(i + j) % len(WORDS)] for j in range(300)) for i in range(4)))
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {w: i for i, w in enumerate(["[UNK]", *WORDS, "<|endoftext|>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (work / "path" / "to").mkdir(parents=True)
    tok.save(str(work / "path" / "to" / "tokenizer.json"))
    from tests.unit._tiny_checkpoint import write_tiny_checkpoint
    write_tiny_checkpoint(work / "runs" / "tiny" / "checkpoints", seed=0)


def prepare(command, work, index):
    """argv and environment of a README command, run from `work`, reduced when it trains."""
    tokens = shlex.split(command)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               MOE_TRAIN_ROOT=str(REPO), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    while re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
        key, value = tokens.pop(0).split("=", 1)
        env[key] = value
    kind = classify(tokens)
    argv = [str(REPO / t) if t.startswith(("scripts/", "moe_train/configs/")) else t for t in tokens]
    if argv[0] == "python":
        argv[0] = sys.executable
    if argv[0] == "torchrun":
        argv[:1] = [sys.executable, "-m", "torch.distributed.run"]
    if kind == "train":
        own_dir = any(t.startswith("logging.dir=") for t in tokens)  # a later command reads its checkpoints
        run_dir = [] if own_dir else [f"logging.dir={work / 'runs' / f'readme{index}'}"]
        for override in TRAIN_REDUCTION + run_dir + [f"data.cache_dir={work / 'cache'}"]:
            argv += ["--set", override]
    return kind, argv, env


@pytest.mark.slow
def test_every_readme_command_runs_or_is_skipped(tmp_path):
    commands = readme_commands(README.read_text(encoding="utf-8"))
    unknown = [c for c in commands if c not in {normalize(s) for s in SKIPPED}
               and classify(shlex.split(c)) is None]
    assert not unknown, ("README commands neither run by this test nor listed in SKIPPED (say why): "
                         + "; ".join(unknown))
    stale = [s for s in SKIPPED if normalize(s) not in commands]
    assert not stale, f"SKIPPED names commands no longer in README.md: {stale}"

    from kernels_cuda import build_cpu

    assert build_cpu.ensure_built() is None  # the `native` commands run the kernels' CPU emulation
    work = tmp_path / "work"
    work.mkdir()
    make_inputs(work)
    ran, failures = [], []
    for index, command in enumerate(commands):
        if command in {normalize(s) for s in SKIPPED}:
            print(f"skip: {command}")
            continue
        kind, argv, env = prepare(command, work, index)
        start = time.monotonic()
        res = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=300)
        print(f"{kind} ({time.monotonic() - start:.1f} s, exit {res.returncode}): {command}")
        ran.append(kind)
        output = res.stdout + res.stderr
        if res.returncode != 0:
            failures.append(f"exit {res.returncode}: {command}\n{res.stdout[-2000:]}{res.stderr[-3000:]}")
        elif kind == "train" and "done: 2 steps" not in output:
            failures.append(f"not reduced to 2 steps: {command}\n{output[-2000:]}")
        elif kind == "help" and not res.stdout.strip():
            failures.append(f"printed nothing: {command}\n{output[-2000:]}")
    assert not failures, "README commands failed:\n" + "\n\n".join(failures)
    assert {"train", "data", "plan", "generate"} <= set(ran), ran
