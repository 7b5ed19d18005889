"""Parallel degrees from the config: defaults from the strategy, explicit degrees, and one-line errors."""

from __future__ import annotations

import pytest

from clustertrain.config.schema import ParallelConfig
from clustertrain.distributed.env import RankInfo
from clustertrain.distributed.mesh import degrees
from clustertrain.errors import ConfigError


def ranks(world: int, per_node: int | None = None) -> RankInfo:
    return RankInfo(0, world, 0, per_node or world, 0, "localhost", 29500, "single")


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
    assert degrees(ParallelConfig(**settings), ranks(world, per_node=8)) == expected


@pytest.mark.parametrize("settings, world, message", [
    (dict(tp=3), 4, "parallel.pp × parallel.tp = 1 × 3 does not divide the 4 ranks; use pp × tp in [1, 2, 4]"),
    (dict(strategy="zero3", dp_shard=3, tp=2), 8, "dp_replicate × dp_shard must be 4 (each one of [1, 2, 4])"),
    (dict(strategy="zero3", dp_shard=2, dp_replicate=2), 8, "must equal the 8 ranks"),
    (dict(strategy="ddp", dp_shard=2), 4, "parallel.dp_shard = 2 shards, but parallel.strategy is ddp"),
    (dict(strategy="hybrid_zero2", hybrid_shard_size=3), 4, "hybrid_shard_size = 3 does not divide the 4"),
])
def test_degrees_that_do_not_fit_name_what_would(settings, world, message):
    with pytest.raises(ConfigError) as error:
        degrees(ParallelConfig(**settings), ranks(world))
    assert message in str(error.value) and "\n" not in str(error.value)
