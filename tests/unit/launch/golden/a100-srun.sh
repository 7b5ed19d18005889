#!/bin/bash
# clustertrain job for run 'default', from configs/llama.yaml; preset a100: generic NVIDIA A100 nodes (HGX/DGX, 8 GPUs, InfiniBand).
# Submit with `clustertrain slurm submit CONFIG` (it records the job chain in the run directory),
# or with `sbatch` on this file. Follow it with `clustertrain slurm status RUN_DIR`.
#SBATCH --job-name=default
#SBATCH --account=abc123
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=1
#SBATCH --time=02:00:00
#SBATCH --output=/scratch/runs/llama/slurm/%j.out
#SBATCH --open-mode=append
#SBATCH --chdir=/work/project
#SBATCH --signal=B:USR1@300
#SBATCH --requeue

# Slurm's warning (USR1 before the time limit, or at preemption) reaches only this shell. Remember it from
# here on; once training runs, pass it to the ranks, which agree on a step, save it and exit 75.
# The exit codes this script speaks (75 requeue me, 1 failed, 2 a user error) are clustertrain.errors.ExitCode.
signalled=0
trap 'signalled=1' USR1 TERM

# Environment: the preset's, then slurm.env. Compute nodes run offline.
export HF_HUB_OFFLINE=1
export HF_DATASETS_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export TORCH_NCCL_TRACE_BUFFER_SIZE=2000
export TORCH_NCCL_DUMP_ON_TIMEOUT=1
export OMP_NUM_THREADS=1

python=/opt/venv/bin/python
run_dir=/scratch/runs/llama
end_job() {  # finished: done; stopped unfinished by a signal: requeue; failed (an error): stop here
    exec "$python" -m clustertrain slurm job-end "$run_dir" --exit-code "$1" --signalled "$signalled" --on-stop requeue --max-restarts 20 --max-start-retries 2
}
"$python" -m clustertrain slurm job-start "$run_dir" --max-restarts 20 || exit 1
export CLUSTERTRAIN_USER_ERROR_FILE=/scratch/runs/llama/slurm/user-error.txt  # a rank's user error, for end_job: never retried
if [ "$signalled" = 1 ]; then end_job 0; fi  # warned during the setup: no time to train

# One task per rank: ranks come from Slurm's variables, MASTER_PORT from the job id.
srun --ntasks-per-node=8 --cpus-per-task=1 --kill-on-bad-exit=1 \
    "$python" -m clustertrain train /work/project/configs/llama.yaml &
step=$!
trap 'signalled=1; kill -USR1 "$step" 2>/dev/null' USR1
while :; do  # a trapped signal interrupts wait: wait again for the ranks to save and exit
    wait "$step"; rc=$?
    if [ "$rc" -gt 128 ] && kill -0 "$step" 2>/dev/null; then continue; fi
    break
done
end_job "$rc"
