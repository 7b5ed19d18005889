# One task per node running torchrun; torchrun passes USR1 on to its ranks and waits for their save.
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=@{signal_before}
@{srun} \
    "$python" -m torch.distributed.run --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node=@{tasks_per_node} \
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" --max-restarts=0 \
    @{train}@{then}
