"""`clustertrain plan --nodes N` on CPU clusters: ranks per node from slurm.tasks_per_node (as `config check --nodes`
reads them), and a CPU rank's peak and memory are this machine's shared by the ranks of one node, never by the
whole world (issue 37: `plan --world 80` of a 2-ranks-a-node CPU config said "0 tokens/s")."""

from __future__ import annotations

import json

from helpers import TINY

from clustertrain.cli import main
from clustertrain.model.estimate import measure_cpu_peak

CPU_NODES = [*TINY, "parallel.device=cpu", "parallel.param_dtype=float32", "slurm.tasks_per_node=2",
             "train.global_batch_size=160"]


def planned(capsys, *argv: str, sets: list[str] = CPU_NODES) -> dict:
    assert main(["plan", *argv, "--json", *[f"--set={o}" for o in sets]]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_nodes_on_cpu_takes_the_ranks_per_node_of_the_slurm_section_and_shares_one_node(capsys):
    import torch

    by_nodes = planned(capsys, "--nodes", "40")
    assert by_nodes["layout"]["world_size"] == 80 and by_nodes["per_node"] == 2
    assert main(["config", "check", "--nodes", "40", *[f"--set={o}" for o in CPU_NODES]]) == 0
    assert "on 80 rank(s) (40 node(s) × 2)" in capsys.readouterr().out, "the same world as config check's"

    by_world = planned(capsys, "--world", "80")
    assert by_world["per_node"] == 2 and by_world["device"] == by_nodes["device"]
    rank_peak = measure_cpu_peak(torch.float32) / 2  # this machine's, shared by the 2 ranks of one node
    assert by_world["device"]["peak_flops"] == rank_peak
    assert by_world["tokens_per_s"] > 1000, "a rank's peak, not this machine's divided over 80 ranks"

    alone = planned(capsys, "--world", "2", sets=[*TINY, "parallel.device=cpu", "parallel.param_dtype=float32"])
    assert alone["per_node"] == 2, "no ranks per node stated: --world N runs on one node, as train --nproc N"
    assert main(["plan", "--nodes", "4", *[f"--set={o}" for o in (*TINY, "parallel.device=cpu")]]) == 0
    out = capsys.readouterr().out
    assert "on 4 ranks (4 nodes × 1) of this machine's CPU" in out, "a CPU node without tasks_per_node: 1 rank"
