#!/bin/bash
# llama3-405b on 2048 node(s) x 8 GPUs of h100-80g (written by meshplan); submit with: sbatch meshplan_sbatch.sh
#SBATCH --job-name=meshplan-llama3-405b
#SBATCH --nodes=2048
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
set -euo pipefail

# the rendezvous: torchrun's c10d store on the job's first node (read whole: a pipe into head would
# end scontrol with SIGPIPE on a long node list, which pipefail turns into a failed job)
mapfile -t job_nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=${job_nodes[0]}

# one task per node; each starts torchrun with the node's GPUs (meshplan run launches it)
srun --kill-on-bad-exit=1 bash -c 'meshplan run --plan plan.json --model llama3-405b --steps 10 --nproc 8 --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" --rdzv-endpoint "$1":29500' _ "$head_node"
