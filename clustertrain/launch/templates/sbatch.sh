#!/bin/bash
# clustertrain job for run @{name}, from @{source}; preset @{preset}: @{description}.
# Submit with `clustertrain slurm submit CONFIG` (it records the job chain in the run directory),
# or with `sbatch` on this file. Follow it with `clustertrain slurm status RUN_DIR`.
@{sbatch}
@{cpu_count}
# Slurm's warning (USR1 before the time limit, or at preemption) reaches only this shell. Remember it from
# here on; once training runs, pass it to the ranks, which agree on a step, save it and exit 75.
# The exit codes this script speaks (75 requeue me, 1 failed, 2 a user error) are clustertrain.errors.ExitCode.
signalled=0
trap 'signalled=1' USR1 TERM

@{environment}

python=@{python}
run_dir=@{run_dir}
end_job() {  # finished: done; stopped unfinished by a signal: requeue; failed (an error): stop here
    exec "$python" -m clustertrain slurm job-end "$run_dir" --exit-code "$1" --signalled "$signalled" --on-stop @{on_stop} --max-restarts @{max_restarts} --max-start-retries @{max_start_retries}
}
"$python" -m clustertrain slurm job-start "$run_dir" --max-restarts @{max_restarts} || exit 1
export CLUSTERTRAIN_USER_ERROR_FILE=@{user_error_note}  # a rank's user error, for end_job: never retried
@{doctor}if [ "$signalled" = 1 ]; then end_job 0; fi  # warned during the setup: no time to train

@{launch}
step=$!
trap 'signalled=1; kill -USR1 "$step" 2>/dev/null' USR1
while :; do  # a trapped signal interrupts wait: wait again for the ranks to save and exit
    wait "$step"; rc=$?
    if [ "$rc" -gt 128 ] && kill -0 "$step" 2>/dev/null; then continue; fi
    break
done
end_job "$rc"
