"""parallel.sequence_parallel settled once on the layout, and refused in one line where it cannot run."""

from __future__ import annotations

import pytest

from clustertrain.config.layout import check_world, resolve_layout
from clustertrain.resolve.load import load_checked_config
from clustertrain.model.spec import model_shape
from helpers import TINY


def _config(*sets: str):
    return load_checked_config(None, [*TINY, *sets])


def _problems(world: int, *sets: str) -> list[str]:
    config = _config(*sets)
    return check_world(config, world, shape=model_shape(config.model, config.data.vocab_size))


@pytest.mark.parametrize("sets, world, on", [
    (("parallel.tp=2",), 2, True),  # auto: on with tp and a family that declares its norms
    (("parallel.tp=2", "parallel.sequence_parallel=false"), 2, False),
    ((), 1, False),
    (("parallel.tp=2", "model.arch=cohere", "model.config={}"), 2, False),  # auto: no declared norms, off
    (("parallel.tp=2", "lora.rank=4"), 2, True),
    (("parallel.tp=2", "data.seq_len=63"), 2, False),  # auto: a sequence tp does not divide, off
])
def test_auto_is_settled_on_the_layout(sets, world, on):
    config = _config(*sets)
    layout = resolve_layout(config, world, shape=model_shape(config.model, config.data.vocab_size))
    assert layout.sequence_parallel is on and layout.to_json()["sequence_parallel"] is on


@pytest.mark.parametrize("sets, world, names", [
    (("parallel.sequence_parallel=true",), 1, "parallel.tp"),
    (("parallel.sequence_parallel=true", "parallel.tp=2", "model.arch=cohere", "model.config={}"), 2, "'cohere'"),
    (("parallel.sequence_parallel=true", "parallel.tp=2", "data.seq_len=63"), 2, "use 62 or 64"),
])
def test_sequence_parallel_where_it_cannot_run_is_one_line(sets, world, names):
    problems = _problems(world, *sets)
    assert len(problems) == 1 and "\n" not in problems[0], problems
    assert "parallel.sequence_parallel" in problems[0] and names in problems[0], problems
