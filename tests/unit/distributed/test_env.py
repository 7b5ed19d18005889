"""Launcher detection from realistic launcher environments (no processes are started)."""

from __future__ import annotations

import pytest

from clustertrain.distributed.env import RankInfo, detect_launcher, expand_hostlist
from clustertrain.errors import LaunchError

# What `sbatch -N2 --ntasks-per-node=2` exports to the batch shell and inherits everywhere below.
SBATCH = {
    "SLURM_JOB_ID": "42",
    "SLURM_JOBID": "42",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_NODELIST": "node[1-2]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "4",
    "SLURM_NPROCS": "4",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURMD_NODENAME": "node1",
    "SLURM_SUBMIT_DIR": "/home/alice/run",
}


def srun_task(procid: int, localid: int, nodeid: int, **extra: str) -> dict[str, str]:
    """Environment of one task of `srun -N2 --ntasks-per-node=2` inside SBATCH."""
    return {
        **SBATCH,
        "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid),
        "SLURMD_NODENAME": f"node{nodeid + 1}",
        **extra,
    }


def torchrun_worker(rank: int, local_rank: int, group_rank: int, **extra: str) -> dict[str, str]:
    """Environment of a worker of `torchrun --nnodes=2 --nproc-per-node=4`."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": "8",
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": str(group_rank),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": "8",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_RESTART_COUNT": "0",
        **extra,
    }


def ompi_rank(rank: int, size: int, local_rank: int, local_size: int, **extra: str) -> dict[str, str]:
    """Environment Open MPI's mpirun gives one rank."""
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
        # The rank on the node across all jobs; not a node index.
        "OMPI_COMM_WORLD_NODE_RANK": str(local_rank),
        "OMPI_UNIVERSE_SIZE": str(size),
        "PMIX_RANK": str(rank),
        "PMIX_NAMESPACE": "prterun-node1-1234@1",
        **extra,
    }


# --- one test per launcher -------------------------------------------------------------


def test_torchrun_worker():
    info = detect_launcher(torchrun_worker(rank=6, local_rank=2, group_rank=1))
    assert info == RankInfo(6, 8, 2, 4, 1, "node1", 29400, "torchrun")


def test_torchrun_defaults_without_group_rank_or_master():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    info = detect_launcher(env)
    assert (info.node_rank, info.master_addr, info.master_port) == (1, "127.0.0.1", 29500)


def test_srun_task():
    info = detect_launcher(srun_task(procid=3, localid=1, nodeid=1))
    # Job 42 gets port 20042, so two jobs sharing a node do not collide.
    assert info == RankInfo(3, 4, 1, 2, 1, "node1", 20042, "slurm")


def test_srun_uneven_tasks_per_node_indexed_by_node():
    env = srun_task(
        procid=6, localid=0, nodeid=3,
        SLURM_STEP_NUM_TASKS="7", SLURM_STEP_TASKS_PER_NODE="2(x3),1", SLURM_STEP_NODELIST="gpu[07-10]",
    )
    info = detect_launcher(env)
    assert (info.world_size, info.local_world_size, info.node_rank) == (7, 1, 3)
    assert info.master_addr == "gpu07"


def test_srun_master_env_overrides_nodelist_and_job_port():
    info = detect_launcher(srun_task(0, 0, 0, MASTER_ADDR="10.0.0.5", MASTER_PORT="12345"))
    assert (info.master_addr, info.master_port) == ("10.0.0.5", 12345)


def test_srun_falls_back_to_job_variables():
    env = srun_task(2, 0, 1)
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NODELIST"):
        del env[name]
    assert detect_launcher(env) == RankInfo(2, 4, 0, 2, 1, "node1", 20042, "slurm")


def test_openmpi_mpirun_single_node():
    info = detect_launcher(ompi_rank(rank=3, size=4, local_rank=3, local_size=4))
    assert info == RankInfo(3, 4, 3, 4, 0, "127.0.0.1", 29500, "openmpi")


def test_mpich_hydra():
    env = {
        "PMI_RANK": "5", "PMI_SIZE": "8", "PMI_FD": "6",
        "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4",
        "MASTER_ADDR": "login1", "MASTER_PORT": "29600",
    }
    assert detect_launcher(env) == RankInfo(5, 8, 1, 4, 1, "login1", 29600, "mpich")


def test_plain_process_is_single():
    assert detect_launcher({"HOME": "/home/alice"}) == RankInfo(0, 1, 0, 1, 0, "127.0.0.1", 29500, "single")
    assert detect_launcher({"MASTER_PORT": "30000"}).master_port == 30000


# --- precedence ------------------------------------------------------------------------


def test_srun_torchrun_worker_ignores_inherited_slurm_vars():
    # `srun -N2 --ntasks-per-node=1 torchrun ...`: the step has one task per node, and
    # every worker inherits its agent's SLURM_PROCID.
    slurm = srun_task(0, 0, 0, SLURM_STEP_NUM_TASKS="1", SLURM_NTASKS="1", SLURM_STEP_TASKS_PER_NODE="1")
    info = detect_launcher({**slurm, **torchrun_worker(rank=3, local_rank=3, group_rank=0)})
    assert info == RankInfo(3, 8, 3, 4, 0, "node1", 29400, "torchrun")


def test_mpirun_inside_allocation_ignores_wrong_slurm_vars():
    # mpirun starts its daemons with srun, so every rank sees SLURM_PROCID=0, SLURM_NTASKS=1.
    slurm = srun_task(0, 0, 0, SLURM_STEP_ID="1", SLURM_STEP_NUM_TASKS="1", SLURM_NTASKS="1",
                      SLURM_STEP_TASKS_PER_NODE="1", SLURM_STEP_NODELIST="node2")
    info = detect_launcher({**slurm, **ompi_rank(rank=3, size=4, local_rank=1, local_size=2)})
    # Master is the first host of the job, not of the daemon step.
    assert info == RankInfo(3, 4, 1, 2, 1, "node1", 20042, "openmpi")


def test_mpich_mpirun_inside_allocation():
    slurm = srun_task(1, 0, 1, SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="1(x2)")
    env = {**slurm, "PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    assert detect_launcher(env) == RankInfo(2, 4, 0, 2, 1, "node1", 20042, "mpich")


def test_srun_pmi2_direct_launch_uses_slurm_vars():
    # srun --mpi=pmi2 also exports PMI_RANK/PMI_SIZE but no MPI_LOCALRANKID.
    env = srun_task(3, 1, 1, PMI_RANK="3", PMI_SIZE="4", PMI_FD="5")
    assert detect_launcher(env) == RankInfo(3, 4, 1, 2, 1, "node1", 20042, "slurm")


def test_sbatch_batch_shell_is_single_process():
    info = detect_launcher(SBATCH)
    assert (info.rank, info.world_size, info.launcher) == (0, 1, "single")


# --- errors ----------------------------------------------------------------------------


def test_multinode_mpirun_without_master_addr():
    with pytest.raises(LaunchError, match="MASTER_ADDR") as exc:
        detect_launcher(ompi_rank(rank=5, size=8, local_rank=1, local_size=4))
    assert "mpirun -x MASTER_ADDR" in str(exc.value)
    assert "\n" not in str(exc.value)


def test_multinode_mpirun_with_master_addr():
    info = detect_launcher(ompi_rank(5, 8, 1, 4, MASTER_ADDR="node1"))
    assert (info.node_rank, info.master_addr) == (1, "node1")


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one'"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK='2'"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1'"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
        ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK='2'"),
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "http"}, "MASTER_PORT='http'"),
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, "MASTER_PORT='70000'"),
        (ompi_rank(4, 4, 0, 4), "OMPI_COMM_WORLD_RANK='4'"),
        (ompi_rank(0, 4, 4, 4), "OMPI_COMM_WORLD_LOCAL_RANK='4'"),
        (srun_task(3, 2, 1), "SLURM_LOCALID='2'"),
        (srun_task(3, 1, 1, SLURM_STEP_NUM_TASKS="x"), "SLURM_STEP_NUM_TASKS='x'"),
        (srun_task(3, 1, 1, SLURM_STEP_TASKS_PER_NODE="2(3)"), "SLURM_STEP_TASKS_PER_NODE='2(3)'"),
        (srun_task(3, 1, 2), "SLURM_NODEID=2"),
        (srun_task(3, 1, 1, SLURM_STEP_NODELIST="node[1-2"), "SLURM_STEP_NODELIST"),
        (srun_task(3, 1, 1, SLURM_JOB_ID="abc"), "SLURM_JOB_ID='abc'"),
    ],
)
def test_malformed_values_name_the_variable(env, needle):
    with pytest.raises(LaunchError) as exc:
        detect_launcher(env)
    assert needle in str(exc.value)
    assert "\n" not in str(exc.value)


# --- hostlists -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node1", ["node1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("frontier[00001-00002]", ["frontier00001", "frontier00002"]),
        ("node[8-10]", ["node8", "node9", "node10"]),
        ("a[1,3],b[2]", ["a1", "a3", "b2"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("node-1,node-2", ["node-1", "node-2"]),
        ("", []),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    "hostlist", ["node[1-2", "node1-2]", "node[3-1]", "node[1-]", "node[]", "a,,b", "n[[1]]"]
)
def test_expand_hostlist_rejects_malformed(hostlist):
    with pytest.raises(LaunchError, match="host list"):
        expand_hostlist(hostlist)


def test_mpich_without_local_rank_outside_srun():
    with pytest.raises(LaunchError, match="MPI_LOCALRANKID"):
        detect_launcher({"PMI_RANK": "0", "PMI_SIZE": "2"})


def test_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setattr("clustertrain.distributed.env.os.environ", torchrun_worker(1, 1, 0))
    assert detect_launcher().rank == 1


def test_multinode_mpich_without_master_addr_suggests_genv():
    env = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
    with pytest.raises(LaunchError, match="-genv MASTER_ADDR"):
        detect_launcher(env)
