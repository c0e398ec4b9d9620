#!/bin/bash
# Multi-node CLIP pre-training under Slurm: one `accelerate launch` per node, 8 GPUs each.
#   sbatch accelerate_configs/slurm_multi_node.sh recipes/configs/clip_tiny.yaml --save_steps 1000
# Preemption and time limits: Slurm signals this shell (B:USR1) 120 s before it kills the job; the
# shell passes SIGTERM to every task (srun -> the accelerate launcher -> the workers), the recipe
# saves a checkpoint at the next optimizer step and exits with 75, and the job requeues itself.
# The first start and every requeue run the same command: `--resume_from_checkpoint latest` starts
# from step 0 when there is no complete checkpoint yet. The launcher gives workers 30 s after the
# signal before it kills them; a save cut short stays partial and is never resumed from.
#SBATCH --job-name=clip_pretrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --signal=B:USR1@120
#SBATCH --open-mode=append
set -euo pipefail
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
export MAIN_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export NUM_PROCESSES=$((SLURM_NNODES * GPUS_PER_NODE))
# Single quotes: SLURM_NODEID must be read inside each node's task, not here.
srun bash -c 'accelerate launch --config_file accelerate_configs/multi_node.yaml \
    --num_machines "$SLURM_NNODES" --num_processes "$NUM_PROCESSES" --machine_rank "$SLURM_NODEID" \
    --main_process_ip "$MAIN_NODE" --main_process_port "${MAIN_PROCESS_PORT:-29500}" \
    recipes/clip_pretrain.py "$@" --resume_from_checkpoint latest' _ "$@" &
TRAINING=$!

checkpoint_and_requeue() {
    echo "$(date -Is) preemption signal: checkpoint at the next optimizer step, then requeue"
    kill -TERM "$TRAINING"  # srun passes it on to every task
    wait "$TRAINING" || true
    scontrol requeue "$SLURM_JOB_ID"
}
trap checkpoint_and_requeue USR1 TERM
wait "$TRAINING"
