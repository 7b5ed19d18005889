# One task per rank: ranks come from Slurm's variables, MASTER_PORT from the job id.
@{srun} \
    "$python" @{train}@{then}
