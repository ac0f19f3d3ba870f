#!/bin/bash

# Parameters
#SBATCH --cpus-per-task=1
#SBATCH --error=/runs/gpt_pp2_dp2/submitit/%j_0_log.err
#SBATCH --job-name=gpt_pp2_dp2
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --open-mode=append
#SBATCH --output=/runs/gpt_pp2_dp2/submitit/%j_0_log.out
#SBATCH --partition=dev
#SBATCH --requeue
#SBATCH --signal=USR2@60
#SBATCH --time=15
#SBATCH --wckey=submitit

# setup
unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE
export NCCL_IB_DISABLE=1
export OMP_NUM_THREADS=1

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /runs/gpt_pp2_dp2/submitit/%j_%t_log.out --error /runs/gpt_pp2_dp2/submitit/%j_%t_log.err --kill-on-bad-exit=1 <PYTHON> -u -m submitit.core._submit /runs/gpt_pp2_dp2/submitit
