"""Detect which launcher started this process and the rank layout it implies."""

from __future__ import annotations

import itertools
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from clustertrain.errors import LaunchError, UserError

DEFAULT_ADDR = "127.0.0.1"
DEFAULT_PORT = 29500
# One host pattern: plain characters and bracket groups, whose commas do not split hosts.
_HOST = r"(?:[^,\[\]\s]|\[[^\[\]]*\])+"


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job, and where rank 0 listens."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    launcher: str  # one of "torchrun", "openmpi", "mpich", "slurm", "single"


def is_rank0() -> bool:
    """Whether this process is rank 0 (the one that talks), with or without a process group."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank() == 0
    try:
        return detect_launcher().rank == 0
    except UserError:
        return True


def node_name(environ: Mapping[str, str] | None = None) -> str:
    """This node's name as Slurm knows it (SLURMD_NODENAME, what `--exclude` takes), else the host name."""
    env = os.environ if environ is None else environ
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def detect_launcher(environ: Mapping[str, str] | None = None) -> RankInfo:
    """Read the rank layout from the variables the launcher exported.

    Args:
        environ: The environment to read; defaults to ``os.environ``.

    Returns:
        The layout; a process no launcher started is rank 0 of 1, launcher "single".

    Raises:
        LaunchError: A variable is malformed, or a multi-node MPI job lacks MASTER_ADDR.
    """
    env = os.environ if environ is None else environ
    # The order follows what each launcher sets, innermost first. torchrun workers
    # under srun inherit SLURM_PROCID=0/SLURM_NTASKS=1; mpirun inside an allocation
    # starts its daemons with srun, so every rank sees SLURM_PROCID=0 and a
    # SLURM_STEP_ID. The launcher closest to the process knows the truth.
    if "RANK" in env and "WORLD_SIZE" in env:
        return _torchrun(env)
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
        return _mpi(env, "openmpi", (*names, "OMPI_COMM_WORLD_LOCAL_SIZE"))
    # srun --mpi=pmi2 and Cray PMI also export PMI_RANK/PMI_SIZE, but only hydra
    # sets MPI_LOCALRANKID; there the SLURM_* variables are right, so use them.
    if "PMI_RANK" in env and "PMI_SIZE" in env and (
        "MPI_LOCALRANKID" in env or "SLURM_STEP_ID" not in env
    ):
        return _mpi(env, "mpich", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"))
    # Only srun tasks get SLURM_STEP_ID; the sbatch batch shell also has
    # SLURM_PROCID=0 and SLURM_NTASKS=N, yet it is one process, not rank 0 of N.
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        return _slurm(env)
    return RankInfo(0, 1, 0, 1, 0, DEFAULT_ADDR, _port(env, job_unique=False), "single")


def _torchrun(env: Mapping[str, str]) -> RankInfo:
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    local_world = _int(env, "LOCAL_WORLD_SIZE", world)
    local_rank = _int(env, "LOCAL_RANK", rank % max(local_world, 1))
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    _validate(env, names, rank, world, local_rank, local_world)
    node = _int(env, "GROUP_RANK", rank // local_world)
    addr = env.get("MASTER_ADDR") or DEFAULT_ADDR
    port = _port(env, job_unique=False)
    return RankInfo(rank, world, local_rank, local_world, node, addr, port, "torchrun")


def _mpi(env: Mapping[str, str], launcher: str, names: tuple[str, ...]) -> RankInfo:
    rank, world, local_rank, local_world = (_int(env, n) for n in names)
    _validate(env, names, rank, world, local_rank, local_world)
    # OMPI_COMM_WORLD_NODE_RANK is the rank among *all* jobs on the node, not a
    # node index, and hydra exports none; both map ranks to nodes in blocks by default.
    node = rank // local_world
    if env.get("MASTER_ADDR"):
        addr = env["MASTER_ADDR"]
    elif var := _first_set(env, ("SLURM_JOB_NODELIST", "SLURM_NODELIST")):
        addr = _first_host(env, var)
    elif local_world == world:
        addr = DEFAULT_ADDR
    else:
        how = "mpirun -x MASTER_ADDR=$(hostname)"
        if launcher == "mpich":
            how = "mpiexec -genv MASTER_ADDR $(hostname)"
        raise LaunchError(
            f"{launcher} started {world} ranks on several nodes but MASTER_ADDR is not set; "
            f"export it to every rank, e.g. `{how} ...`"
        )
    return RankInfo(rank, world, local_rank, local_world, node, addr, _port(env, job_unique=True), launcher)


def _slurm(env: Mapping[str, str]) -> RankInfo:
    world_var = _first_set(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")) or "SLURM_NTASKS"
    tasks_var = _first_set(env, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    rank, world = _int(env, "SLURM_PROCID"), _int(env, world_var)
    local_rank, node = _int(env, "SLURM_LOCALID"), _int(env, "SLURM_NODEID")
    if tasks_var is None:
        raise LaunchError("srun task has neither SLURM_STEP_TASKS_PER_NODE nor SLURM_TASKS_PER_NODE set")
    per_node = _parse_tasks_per_node(tasks_var, env[tasks_var])
    if not 0 <= node < len(per_node):
        raise LaunchError(f"SLURM_NODEID={node} has no entry in {tasks_var}={env[tasks_var]!r}")
    names = ("SLURM_PROCID", world_var, "SLURM_LOCALID", tasks_var)
    _validate(env, names, rank, world, local_rank, per_node[node])
    if env.get("MASTER_ADDR"):
        addr = env["MASTER_ADDR"]
    elif var := _first_set(env, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")):
        addr = _first_host(env, var)
    else:
        raise LaunchError("srun task has no SLURM_STEP_NODELIST or SLURM_JOB_NODELIST; export MASTER_ADDR")
    port = _port(env, job_unique=True)
    return RankInfo(rank, world, local_rank, per_node[node], node, addr, port, "slurm")


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm compressed host list such as ``"gpu[01-03,07],login1"``.

    Zero padding is kept and several bracket groups in one name expand as a
    cartesian product (``"r[1-2]-n[1-2]"`` gives r1-n1, r1-n2, r2-n1, r2-n2).

    Args:
        hostlist: The compressed list, as in SLURM_JOB_NODELIST.

    Returns:
        The host names in order.

    Raises:
        LaunchError: The list is malformed (unbalanced brackets, bad range).
    """
    hostlist = hostlist.strip()
    if hostlist and not re.fullmatch(rf"{_HOST}(?:,{_HOST})*", hostlist):
        raise LaunchError(f"cannot parse Slurm host list {hostlist!r}: unbalanced brackets or stray commas")
    hosts: list[str] = []
    for pattern in re.findall(_HOST, hostlist):
        # re.split with a capture group alternates literal text and bracket bodies.
        parts = re.split(r"\[([^\]]*)\]", pattern)
        choices = [[p] if i % 2 == 0 else _expand_group(hostlist, p) for i, p in enumerate(parts)]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def _expand_group(hostlist: str, body: str) -> list[str]:
    values: list[str] = []
    for item in (i.strip() for i in body.split(",")):
        m = re.fullmatch(r"([0-9]+)-([0-9]+)", item)
        if m and int(m[1]) <= int(m[2]):
            # Slurm pads every number to the width of the range's lower bound.
            values.extend(f"{n:0{len(m[1])}d}" for n in range(int(m[1]), int(m[2]) + 1))
        elif item and "-" not in item:
            values.append(item)
        else:
            raise LaunchError(f"cannot parse Slurm host list {hostlist!r}: bad range {item!r}")
    return values


def _parse_tasks_per_node(name: str, value: str) -> list[int]:
    counts: list[int] = []
    for item in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise LaunchError(f"{name}={value!r} is not a Slurm task count list like '2(x3),1'")
        counts.extend([int(m[1])] * int(m[2] or 1))
    return counts


def _first_host(env: Mapping[str, str], name: str) -> str:
    try:
        hosts = expand_hostlist(env[name])
    except LaunchError as exc:
        raise LaunchError(f"{name}: {exc}") from None
    if not hosts:
        raise LaunchError(f"{name} is empty; export MASTER_ADDR")
    return hosts[0]


def _first_set(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((n for n in names if env.get(n)), None)


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    if name not in env:
        if default is None:
            raise LaunchError(f"{name} is not set, but the launcher should have set it")
        return default
    if not re.fullmatch(r"\s*[+-]?\d+\s*", env[name]):
        raise LaunchError(f"{name}={env[name]!r} is not an integer")
    return int(env[name])


def _validate(env: Mapping[str, str], names: tuple[str, ...], *values: int) -> None:
    """Check rank < world and local rank < local world; names are the four source variables."""
    rank, world, local_rank, local_world = values
    rank_n, world_n, local_rank_n, local_world_n = (f"{n}={env.get(n, '(unset)')!r}" for n in names)
    if world < 1:
        raise LaunchError(f"{world_n} must be at least 1")
    if local_world < 1:
        raise LaunchError(f"{local_world_n} must give at least 1 task per node")
    if not 0 <= rank < world:
        raise LaunchError(f"{rank_n} is not in [0, {world}) ({world_n})")
    if not 0 <= local_rank < local_world:
        raise LaunchError(f"{local_rank_n} is not in [0, {local_world}) ({local_world_n})")


def _port(env: Mapping[str, str], job_unique: bool) -> int:
    if "MASTER_PORT" not in env:
        # A job-unique port keeps two Slurm jobs that share a node from racing for one port.
        if job_unique and "SLURM_JOB_ID" in env:
            return 20000 + _int(env, "SLURM_JOB_ID") % 20000
        return DEFAULT_PORT
    port = _int(env, "MASTER_PORT")
    if not 0 < port < 65536:
        raise LaunchError(f"MASTER_PORT={env['MASTER_PORT']!r} is not a TCP port (1-65535)")
    return port
