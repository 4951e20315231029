#!/usr/bin/env bash
# Launch DeepSeek-V3-style MoE pretraining.
#
#   bash scripts/pretrain_dsv3.sh [CONFIG] [--set section.key=value ...]
#   bash scripts/pretrain_dsv3.sh --help      # this text; the config keys: python -m moe_train.train --help
#   bash scripts/pretrain_dsv3.sh [CONFIG] --print-config [--set ...]   # the resolved config, nothing started
#   sbatch --nodes 2 scripts/pretrain_dsv3.sh moe_train/configs/dsv3_671b.yaml
#   salloc --nodes 2 bash scripts/pretrain_dsv3.sh CONFIG [--set ...]
#
# Outside Slurm: NPROC_PER_NODE processes (default: the config's parallel.nproc_per_node, else 1)
# under torchrun --standalone, or plain python for one process. Inside an allocation (sbatch or
# salloc): one srun task per node, each running torchrun with a c10d rendezvous on the first node.
#
# Paths: CONFIG is read relative to the current directory (the submit directory under sbatch), else
# relative to the repository. The run stays in the current directory, so relative paths inside the
# config (logging.dir, data.path) are relative to where the job was submitted. The repository is
# this script's parent, or under sbatch (which runs a copy of the script) MOE_TRAIN_ROOT, the submit
# directory or the installed moe_train package.
#
# Logs: under Slurm the job's output file gets everything, and <logging.dir>/slurm-<jobid>/ keeps
# launch.txt (nodes, command, communication settings) and output.log (the output of every node),
# so the logs of successive jobs of one run sit side by side with its metrics and checkpoints.
# Resume: checkpoint.resume defaults to auto, so submitting the same command again continues
# from the latest checkpoint of the run.
# Stop: SIGTERM, SIGUSR1 or Ctrl-C, to this launcher or to any one worker, stops every rank after
# the same step, which they save; then everything exits 0 (torchrun runs as moe_train.launch.torchrun,
# which passes these signals on to its workers, each running moe_train.launch.worker: the trainer with
# these signals noted from its first instant). A second Ctrl-C aborts without a save.
#SBATCH --job-name=moe-train
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
set -euo pipefail

PYTHON=${PYTHON:-python}

for arg in "$@"; do
    if [ "$arg" = --help ] || [ "$arg" = -h ]; then
        # The comment block above, up to the #SBATCH lines (under sbatch $0 is Slurm's copy of this script).
        sed -n '2,/^#SBATCH/{/^#SBATCH/d;s/^# \{0,1\}//;p}' "$0"
        exit 0
    fi
done

find_root() {
    local dir
    for dir in "${MOE_TRAIN_ROOT:-}" "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" "${SLURM_SUBMIT_DIR:-}"; do
        if [ -n "$dir" ] && [ -f "$dir/moe_train/train.py" ]; then
            echo "$dir"
            return
        fi
    done
    "$PYTHON" -c 'import moe_train, pathlib; print(pathlib.Path(moe_train.__file__).resolve().parents[1])'
}
ROOT=$(find_root) || { echo "error: cannot find the repository; set MOE_TRAIN_ROOT" >&2; exit 2; }
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

CONFIG=$ROOT/moe_train/configs/demo.yaml
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then
    CONFIG=$1
    shift
fi
if [ ! -f "$CONFIG" ] && [ "${CONFIG#/}" = "$CONFIG" ] && [ -f "$ROOT/$CONFIG" ]; then
    CONFIG=$ROOT/$CONFIG
fi
[ -f "$CONFIG" ] || { echo "error: config file not found: $CONFIG" >&2; exit 2; }
CONFIG="$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")"

for arg in "$@"; do
    if [ "$arg" = --print-config ]; then
        exec "$PYTHON" -m moe_train.train --config "$CONFIG" "$@"
    fi
done

IN_SLURM=
if [ -n "${SLURM_JOB_ID:-}" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    IN_SLURM=1
fi
NNODES=1
[ -n "$IN_SLURM" ] && NNODES=${SLURM_NNODES:-1}

# Resolve and validate the config and the process layout before starting any process. A stop
# signal meanwhile ends the launcher once the check is done (bash runs a trap after its child):
# nothing has started, so nothing is saved.
stopped_before_start() {
    echo "$1 before any worker started: nothing to save, stopping" >&2
    exit "$2"
}
trap 'stopped_before_start SIGTERM 143' TERM
trap 'stopped_before_start SIGINT 130' INT
trap 'stopped_before_start SIGUSR1 138' USR1
INFO=$("$PYTHON" -m moe_train.preflight.launch_info --config "$CONFIG" --nodes "$NNODES" --log-dir \
    ${NPROC_PER_NODE:+--nproc-per-node "$NPROC_PER_NODE"} "$@") || exit 2
trap - TERM INT USR1
NPROC_PER_NODE=${INFO%%$'\n'*}
LOG_ROOT=${INFO#*$'\n'}

# Communication settings for CUDA GPU nodes; each one keeps a value already in the environment.
# Cluster-specific ones (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NVSHMEM_HCA_LIST) have no safe default:
# set them in the environment of sbatch/salloc. CPU (gloo) runs get none of these.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    # NCCL prints warnings only; NCCL_DEBUG=INFO shows the chosen transports when debugging.
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    # A failed or timed-out collective aborts the communicator and kills the process, so the job
    # fails (and srun --kill-on-bad-exit ends every node) instead of hanging until its time limit.
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    # Free the buffers of asynchronous collectives when they finish rather than at stream sync.
    export TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}
    # NVSHMEM for DeepEP-style internode dispatch: GPU-initiated RDMA (IBGDA) driven by the GPU,
    # deep queue pairs for many in-flight tokens, no NVLink SHARP, few teams, large allocation
    # granularity (DeepEP's own settings).
    export NVSHMEM_IB_ENABLE_IBGDA=${NVSHMEM_IB_ENABLE_IBGDA:-1}
    export NVSHMEM_IBGDA_NIC_HANDLER=${NVSHMEM_IBGDA_NIC_HANDLER:-gpu}
    export NVSHMEM_QP_DEPTH=${NVSHMEM_QP_DEPTH:-1024}
    export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
    export NVSHMEM_MAX_TEAMS=${NVSHMEM_MAX_TEAMS:-7}
    export NVSHMEM_CUMEM_GRANULARITY=${NVSHMEM_CUMEM_GRANULARITY:-536870912}
fi

if [ -n "$IN_SLURM" ]; then
    HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    RDZV_PORT=${RDZV_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
    JOB_LOG_DIR=$LOG_ROOT/slurm-$SLURM_JOB_ID
    mkdir -p "$JOB_LOG_DIR"
    COMMAND=(srun --kill-on-bad-exit=1 --nodes "$NNODES" --ntasks-per-node 1
        "$PYTHON" -m moe_train.launch.torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE"
        --rdzv-backend c10d --rdzv-endpoint "$HEAD_NODE:$RDZV_PORT" --rdzv-id "$SLURM_JOB_ID"
        -m moe_train.launch.worker --config "$CONFIG" "$@")
    {
        echo "job $SLURM_JOB_ID on $SLURM_JOB_NODELIST ($NNODES node(s) x $NPROC_PER_NODE process(es)), cwd $PWD"
        echo "command: ${COMMAND[*]}"
        env | grep -E '^(NCCL|NVSHMEM|TORCH_NCCL)_' | sort || true
    } > "$JOB_LOG_DIR/launch.txt"
    echo "slurm job $SLURM_JOB_ID: $NNODES node(s) x $NPROC_PER_NODE process(es), rendezvous $HEAD_NODE:$RDZV_PORT, logs in $JOB_LOG_DIR"
    "${COMMAND[@]}" 2>&1 | tee -a "$JOB_LOG_DIR/output.log"
    exit "${PIPESTATUS[0]}"
fi

if [ "$NPROC_PER_NODE" = 1 ]; then
    exec "$PYTHON" -m moe_train.launch.worker --config "$CONFIG" "$@"
fi
exec "$PYTHON" -m moe_train.launch.torchrun --standalone --nproc-per-node "$NPROC_PER_NODE" \
    -m moe_train.launch.worker --config "$CONFIG" "$@"
