#!/bin/bash
# Multi-node CLIP pre-training under Slurm: one `accelerate launch` per node, 8 GPUs each.
#   sbatch accelerate_configs/slurm_multi_node.sh recipes/configs/clip_tiny.yaml
#SBATCH --job-name=clip_pretrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --exclusive
set -euo pipefail
GPUS_PER_NODE=8
export MAIN_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export NUM_PROCESSES=$((SLURM_NNODES * GPUS_PER_NODE))
# Single quotes: SLURM_NODEID must be read inside each node's task, not here.
srun bash -c 'accelerate launch --config_file accelerate_configs/multi_node.yaml \
    --num_machines "$SLURM_NNODES" --num_processes "$NUM_PROCESSES" --machine_rank "$SLURM_NODEID" \
    --main_process_ip "$MAIN_NODE" --main_process_port 29500 \
    recipes/clip_pretrain.py "$@"' _ "$@"
