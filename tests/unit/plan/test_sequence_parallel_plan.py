"""A tp layout planned without sequence parallelism says in one line what that costs: the same layout planned with
it, or why it cannot run here."""

from __future__ import annotations

import re

from helpers import TINY

from clustertrain.cli import main

WIDE = ("model.config={hidden_size: 256, intermediate_size: 512, num_hidden_layers: 2, num_attention_heads: 4, "
        "num_key_value_heads: 2, max_position_embeddings: 1024}", "data.seq_len=512", "train.micro_batch_size=4")


def plan_lines(capsys, *overrides: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(["plan", "--world", "2", *[f"--set={o}" for o in (*TINY, *overrides)]])
    return code, capsys.readouterr().err.splitlines()


def test_a_tp_layout_without_sequence_parallelism_is_planned_beside_one_with_it(capsys):
    code, err = plan_lines(capsys, *WIDE, "parallel.tp=2", "parallel.sequence_parallel=false")
    said = [line for line in err if line.startswith("plan: without sequence parallelism")]
    assert code == 0 and len(said) == 1, err
    found = re.search(r"peak ([\d.]+) GB a rank, against ([\d.]+) GB with parallel.sequence_parallel: true", said[0])
    assert found and float(found[1]) > float(found[2]) > 0, said[0]
    _, err = plan_lines(capsys, *WIDE, "parallel.tp=2")  # on by default: nothing to say
    assert not [line for line in err if line.startswith("plan: without sequence parallelism")], err


def test_a_tp_layout_that_cannot_split_its_sequence_says_why(capsys):
    _, err = plan_lines(capsys, "data.seq_len=63", "parallel.tp=2")
    said = [line for line in err if line.startswith("plan: without sequence parallelism")]
    assert len(said) == 1 and "which cannot be split here: data.seq_len = 63 is not a multiple of parallel.tp" in said[0]
