#!/usr/bin/env bash
# Launch DeepSeek-V3-style MoE pretraining.
#
#   bash scripts/pretrain_dsv3.sh [CONFIG] [--set section.key=value ...]
#   sbatch --nodes 2 scripts/pretrain_dsv3.sh moe_train/configs/dsv3_671b.yaml
#
# Outside Slurm: NPROC_PER_NODE processes (default: the config's parallel.nproc_per_node, else 1)
# under torchrun --standalone, or plain python for one process. Inside an allocation: one srun
# task per node, each running torchrun with a c10d rendezvous on the first node of the job.
#SBATCH --job-name=moe-train
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
set -euo pipefail

if [ -n "${SLURM_SUBMIT_DIR:-}" ]; then
    cd "$SLURM_SUBMIT_DIR"
else
    cd "$(dirname "${BASH_SOURCE[0]}")/.."
fi

CONFIG=moe_train/configs/demo.yaml
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then
    CONFIG=$1
    shift
fi
[ -f "$CONFIG" ] || { echo "error: config file not found: $CONFIG" >&2; exit 2; }
PYTHON=${PYTHON:-python}

IN_SLURM=
if [ -n "${SLURM_JOB_ID:-}" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    IN_SLURM=1
fi
NNODES=1
[ -n "$IN_SLURM" ] && NNODES=${SLURM_NNODES:-1}

# Resolve and validate the config and the process layout before starting any process.
NPROC_PER_NODE=$("$PYTHON" -m moe_train.launch_info --config "$CONFIG" --nodes "$NNODES" \
    ${NPROC_PER_NODE:+--nproc-per-node "$NPROC_PER_NODE"} "$@") || exit 2

if [ -n "$IN_SLURM" ]; then
    HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    RDZV_PORT=${RDZV_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
    echo "slurm job $SLURM_JOB_ID: $NNODES node(s) x $NPROC_PER_NODE process(es), rendezvous $HEAD_NODE:$RDZV_PORT"
    exec srun --kill-on-bad-exit=1 --nodes "$NNODES" --ntasks-per-node 1 \
        "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
        --rdzv-backend c10d --rdzv-endpoint "$HEAD_NODE:$RDZV_PORT" --rdzv-id "$SLURM_JOB_ID" \
        -m moe_train.train --config "$CONFIG" "$@"
fi

if [ "$NPROC_PER_NODE" = 1 ]; then
    exec "$PYTHON" -m moe_train.train --config "$CONFIG" "$@"
fi
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC_PER_NODE" \
    -m moe_train.train --config "$CONFIG" "$@"
