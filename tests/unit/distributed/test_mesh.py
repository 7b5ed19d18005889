"""Parallel degrees from the config: defaults from the strategy, explicit degrees, and one-line errors; the mesh
built from the checked layout."""

from __future__ import annotations

import pytest

from clustertrain.config.layout import DIMS, Layout, resolve_layout
from clustertrain.config.schema import ParallelConfig, RunConfig, TrainConfig
from clustertrain.errors import ConfigError


def layout(settings: dict, world: int, per_node: int | None = None) -> Layout:
    """The checked layout of `settings` (parallel.*) on `world` ranks, with a batch that fits any of them."""
    train = TrainConfig(steps=1, micro_batch_size=1, grad_accum=1)  # one row per data-parallel rank
    config = RunConfig(parallel=ParallelConfig(**settings), train=train)
    return resolve_layout(config, world, per_node or world)


def degrees(settings: dict, world: int, per_node: int | None = None) -> tuple[int, int, int, int]:
    found = layout(settings, world, per_node)
    return found.degree("pp"), found.degree("dp_replicate"), found.degree("dp_shard"), found.degree("tp")


@pytest.mark.parametrize("settings, world, expected", [
    (dict(strategy="ddp"), 8, (1, 8, 1, 1)),
    (dict(strategy="zero3"), 8, (1, 1, 8, 1)),
    (dict(strategy="zero3", tp=2), 8, (1, 1, 4, 2)),
    (dict(strategy="ddp", tp=4), 8, (1, 2, 1, 4)),
    (dict(strategy="hybrid_zero3", tp=2), 16, (1, 2, 4, 2)),  # shard within a node of 8 ranks
    (dict(strategy="zero2", dp_replicate=2), 8, (1, 2, 4, 1)),
    (dict(strategy="zero3", dp_shard=2, tp=2), 8, (1, 2, 2, 2)),
])
def test_degrees(settings, world, expected):
    assert degrees(settings, world, per_node=8) == expected


@pytest.mark.parametrize("settings, world, message", [
    (dict(tp=3), 4, "parallel.pp × parallel.tp = 1 × 3 does not divide the 4 ranks; use pp × tp in [1, 2, 4]"),
    (dict(strategy="zero3", dp_shard=3, tp=2), 8, "dp_replicate × dp_shard must be 4 (each one of [1, 2, 4])"),
    (dict(strategy="zero3", dp_shard=2, dp_replicate=2), 8, "must equal the 8 ranks"),
    (dict(strategy="ddp", dp_shard=2), 4, "parallel.dp_shard = 2 shards, but parallel.strategy is ddp"),
    (dict(strategy="hybrid_zero2", hybrid_shard_size=3), 4, "hybrid_shard_size = 3 does not divide the 4"),
])
def test_degrees_that_do_not_fit_name_what_would(settings, world, message):
    with pytest.raises(ConfigError) as error:
        degrees(settings, world)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.fixture
def world_of_8():
    """Rank 0 of 8 on torch's fake backend: groups are made and named as for real, nothing is sent."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("settings, dp_ranks", [
    (dict(strategy="zero3", tp=2), [0, 2, 4, 6]),  # the data-parallel group is the shard group
    (dict(strategy="ddp", tp=2), [0, 2, 4, 6]),  # ... the replicate group
    (dict(strategy="hybrid_zero3", hybrid_shard_size=2, tp=2), [0, 2, 4, 6]),  # both: a group of its own
    (dict(strategy="zero3", pp=2), [0, 1, 2, 3]),
])
def test_each_group_of_ranks_gets_one_process_group(world_of_8, settings, dp_ranks):
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    from clustertrain.distributed.mesh import build_mesh

    before = set(_world.pg_map)
    mesh = build_mesh(layout(settings, 8), "cpu")
    made = set(_world.pg_map) - before
    shared = [tuple(dist.get_process_group_ranks(g)) for g in made if g.size() > 1]
    assert len(set(shared)) == len(shared), f"two process groups of the same ranks: {sorted(shared)}"
    assert dist.get_process_group_ranks(mesh.dp_group) == dp_ranks
    assert (mesh.dp_size, mesh.dp_rank) == (len(dp_ranks), 0)
    both = mesh.degree("dp_replicate") > 1 and mesh.degree("dp_shard") > 1
    if not both:  # the very group FSDP or DDP reduces over: one communicator, not a copy of it
        one = "dp_replicate" if mesh.degree("dp_replicate") > 1 else "dp_shard"
        assert mesh.dp_group is mesh.device_mesh.get_group(one)
    # one per dimension of the mesh (one of all 8 ranks is the world's own), and the data-parallel one if both are used
    assert len(made) == sum(mesh.device_mesh.size(dim) != 8 for dim in range(len(DIMS))) + both


def test_the_mesh_has_a_named_dimension_for_each_of_dims_in_order(world_of_8):
    """A dimension is one entry of DIMS: cp, which no config key sets yet, gets its mesh dimension from the
    layout alone, between the data-parallel ones and tp (innermost: neighbouring ranks)."""
    import dataclasses

    import torch.distributed as dist

    from clustertrain.distributed.mesh import build_mesh

    zero3 = layout(dict(strategy="zero3", tp=2), 8)
    mesh = build_mesh(dataclasses.replace(zero3, degrees={**zero3.degrees, "dp_shard": 2, "cp": 2}), "cpu")
    assert mesh.device_mesh.mesh_dim_names == DIMS
    sizes = [mesh.device_mesh.size(i) for i in range(len(DIMS))]
    assert [mesh.degree(dim) for dim in DIMS] == sizes == [1, 1, 2, 2, 2]
    assert dist.get_process_group_ranks(mesh.device_mesh.get_group("tp")) == [0, 1]
    assert dist.get_process_group_ranks(mesh.device_mesh.get_group("cp")) == [0, 2]
    assert dist.get_process_group_ranks(mesh.dp_group) == [0, 4]
