#!/bin/bash

# Parameters
#SBATCH --account=llm-pretrain
#SBATCH --constraint=a100
#SBATCH --cpus-per-task=12
#SBATCH --error=/shared/runs/gpt_6.7b_tp2_pp2/submitit/%j_0_log.err
#SBATCH --exclusive
#SBATCH --gpus-per-node=8
#SBATCH --job-name=gpt_6.7b_tp2_pp2
#SBATCH --mem=0
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --open-mode=append
#SBATCH --output=/shared/runs/gpt_6.7b_tp2_pp2/submitit/%j_0_log.out
#SBATCH --partition=gpu
#SBATCH --requeue
#SBATCH --signal=USR2@180
#SBATCH --time=1440
#SBATCH --wckey=submitit

# setup
unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE
export NCCL_IB_DISABLE=0
export NCCL_SOCKET_IFNAME=ib0
export NCCL_IB_HCA=mlx5
export NCCL_NET_GDR_LEVEL=PHB
export NCCL_DEBUG=WARN
export GLOO_SOCKET_IFNAME=ib0
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export CUDA_DEVICE_MAX_CONNECTIONS=1

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /shared/runs/gpt_6.7b_tp2_pp2/submitit/%j_%t_log.out --error /shared/runs/gpt_6.7b_tp2_pp2/submitit/%j_%t_log.err --kill-on-bad-exit=1 --cpu-bind=none /opt/venvs/megatron/bin/python -u -m submitit.core._submit /shared/runs/gpt_6.7b_tp2_pp2/submitit
