"""The collective rule: tensors reach a collective only through clustertrain.distributed.collectives, built on the
device of the group's backend (an NCCL group has no CPU backend)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from clustertrain.distributed import collectives

PACKAGE = Path(collectives.__file__).parents[1]
# Collectives that move tensors or objects; barrier moves none and may be called anywhere.
COLLECTIVE = re.compile(
    r"\b(?:dist|torch\.distributed)\.(all_reduce|all_gather\w*|reduce_scatter\w*|broadcast\w*|reduce|gather\w*|"
    r"scatter\w*|all_to_all\w*|send|recv|isend|irecv|batch_isend_irecv)\("
)
# Pipeline P2P moves parameters and gradients, which live on the rank's device by construction.
ALLOWED = {"distributed/collectives.py": None, "parallel/pp.py": {"send", "recv", "batch_isend_irecv"}}


def test_no_module_but_collectives_calls_a_collective_on_its_own_tensors():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for call in COLLECTIVE.findall(line):
                allowed = ALLOWED.get(name, set())
                if allowed is not None and call not in allowed:
                    offenders.append(f"{name}:{lineno}: dist.{call}")
    assert not offenders, "use clustertrain.distributed.collectives instead:\n" + "\n".join(offenders)


def test_the_rule_finds_a_scalar_all_reduce():
    assert COLLECTIVE.findall("    dist.all_reduce(torch.tensor([x]), op=dist.ReduceOp.MAX)") == ["all_reduce"]
    assert COLLECTIVE.findall("dist.all_gather_object(parts, obj)") == ["all_gather_object"]


@pytest.fixture
def world():
    """A one-rank gloo world, plus a group whose backend serves only cuda (as NCCL's does), made of gloo."""
    if "cudaonly" not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            "cudaonly", lambda store, rank, size, timeout: dist.ProcessGroupGloo(store, rank, size, timeout),
            devices=["cuda"],
        )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.new_group(backend="cudaonly")
    dist.destroy_process_group()
    collectives.set_rank_device(torch.device("cpu"))


def test_a_cpu_scalar_fails_on_a_group_without_a_cpu_backend(world):
    """What an all-reduce of `torch.tensor([...])` on an NCCL group does; the helper never builds one there."""
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.ones(1), group=world)


def test_group_device_follows_the_backend(world):
    collectives.set_rank_device(torch.device("cuda", 3))  # a GPU rank: only a device object, nothing allocated
    assert collectives.group_device(world) == torch.device("cuda", 3)
    # gloo accepts cuda tensors too, but by a copy that waits for the GPU: its groups get CPU tensors
    assert collectives.group_device(None) == torch.device("cpu")
    both = dist.new_group(backend="cpu:gloo,cuda:cudaonly")
    assert collectives.group_device(both) == torch.device("cuda", 3)
    collectives.set_rank_device(torch.device("cpu"))
    assert collectives.group_device(both) == torch.device("cpu")
    with pytest.raises(RuntimeError, match="serves neither cpu"):
        collectives.group_device(world)


def test_reductions_on_one_rank(world):
    assert collectives.reduce_values([1, 2.5], op="max") == [1.0, 2.5]
    tensor = torch.tensor([3], dtype=torch.int64)
    reduced = collectives.all_reduce(tensor)
    assert reduced.dtype == torch.int64 and reduced.item() == 3 and reduced is not tensor
    assert collectives.all_gather_objects({"a": 1}) == [{"a": 1}]
    assert collectives.all_gather(torch.tensor(4)).tolist() == [4]  # a 0-d count, as lm-eval gathers it
    assert collectives.all_gather(torch.tensor([1, 2])).tolist() == [1, 2]
    assert collectives.gather_objects("x") == ["x"]
