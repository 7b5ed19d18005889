# CPU-only nodes: the @{tasks_per_node} rank(s) of a node share its cores, each taking cores / @{tasks_per_node} as its CPUs
# and OMP_NUM_THREADS (--exclusive gives the job every core of its nodes; Slurm counts them here).
cpus_per_task=$(( ${SLURM_CPUS_ON_NODE:-1} / @{tasks_per_node} ))
[ "$cpus_per_task" -ge 1 ] || cpus_per_task=1
