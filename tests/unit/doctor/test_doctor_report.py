"""The doctor's verdict from every rank's record, in-process: the slow-rank rule, the ring's rounds, who is named."""

from __future__ import annotations

import pytest

from clustertrain.doctor.measure import ring_rounds, slow_ranks
from clustertrain.doctor.report import diagnose


@pytest.mark.parametrize("seconds, slow", [
    ([1.0, 1.0], []),
    ([1.0, 2.0], [1]),                  # the median of two is their mean
    ([1.0, 1.1, 1.2, 1.0], []),         # within 25% of the median
    ([1.0, 1.0, 1.0, 3.0, 10.0], [3, 4]),  # the median, not the mean (3.2), which one very slow rank drags up
    ([5.0, 1.0, 1.0], [0]),
])
def test_a_rank_slower_than_the_median_by_the_threshold_is_named(seconds, slow):
    assert slow_ranks(seconds, 1.25) == slow


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8, 9])
def test_ring_rounds_cover_every_neighbour_link_once_with_no_rank_twice_in_a_round(world):
    rounds = ring_rounds(world)
    links = [link for links in rounds for link in links]
    want = [(0, 1)] if world == 2 else [(r, (r + 1) % world) for r in range(world)]
    assert sorted(links) == sorted(want)
    for links in rounds:
        ranks = [r for link in links for r in link]
        assert len(ranks) == len(set(ranks))
    assert len(rounds) <= 3


def record(rank: int, host: str, matmul_s: float = 0.01, turn_s: float = 0.002, **facts) -> dict:
    return {"rank": rank, "host": host, "findings": [], "free_memory": None, "matmul_s": matmul_s,
            "matmul_size": (512, "float32"), "link_bytes": 2**20, "turn_s": turn_s,
            "links": {f"{rank}-{rank + 1}": 0.004} if rank % 2 == 0 else {}, "dims": [], "noise_s": 0.0,
            "facts": {"python": "3.11", "torch": "2.8.0", "device": "cpu", "backend": "gloo", **facts}}


def test_differences_within_the_noise_floor_are_not_slow():
    assert slow_ranks([0.001, 0.0025], 1.25, noise=0.002) == []
    assert slow_ranks([0.001, 0.0025, 0.030], 1.25, noise=0.002) == [2]


def test_a_slow_rank_is_named_with_its_host_and_its_host_is_bad():
    records = [record(r, f"node{r // 2}") for r in range(4)]
    records[3]["matmul_s"] = 0.05
    result = diagnose(records, 1.25)
    assert not result["ok"] and result["bad_hosts"] == ["node1"]
    assert len(result["failures"]) == 1 and result["failures"][0].startswith("matmul: rank 3 (node1) took 50.00 ms")
    assert "--exclude=node1" in result["failures"][0]


def test_versions_that_differ_from_rank_0s_are_named():
    records = [record(0, "a"), record(1, "b", torch="2.7.1"), record(2, "b", torch="2.7.1")]
    result = diagnose(records, 1.25)
    assert result["failures"] == ["versions: ranks 1, 2 (b) have torch 2.7.1, rank 0 has 2.8.0: run every rank from "
                                  "one environment (slurm.python, slurm.modules, slurm.setup)"]
    assert result["bad_hosts"] == ["b"]


def test_a_problem_every_node_has_names_no_host():
    records = [record(r, f"node{r}") for r in range(2)]
    for r in records:
        r["findings"] = [{"check": "data", "ok": False, "detail": "data.sources[0]: no such file: fix the path"}]
    result = diagnose(records, 1.25)
    assert result["failures"] == ["data: data.sources[0]: no such file: fix the path"] and result["bad_hosts"] == []
    records[1]["findings"] = [{"check": "data", "ok": True, "detail": "data.sources[0]: 10 documents"}]
    assert diagnose(records, 1.25)["failures"] == ["data: data.sources[0]: no such file: fix the path "
                                                   "(on rank 0 (node0))"]


def test_a_slow_link_is_named_when_neither_end_is_a_slow_rank():
    records = [record(r, f"node{r}") for r in range(4)]
    for r in records:
        r["links"] = {f"{r['rank']}-{(r['rank'] + 1) % 4}": 0.004}
    records[1]["links"] = {"1-2": 0.04}
    result = diagnose(records, 1.25)
    assert [f[:36] for f in result["failures"]] == ["link: ranks 1 (node1) and 2 (node2):"]
    assert result["bad_hosts"] == ["node1", "node2"]


def test_a_device_with_less_free_memory_than_the_plans_peak_is_named():
    records = [record(r, f"gpu-node{r}", device="NVIDIA H100") for r in range(2)]
    records[0]["planned_peak"] = 60e9
    records[0]["free_memory"], records[1]["free_memory"] = 79e9, 20e9
    result = diagnose(records, 1.25)
    assert result["failures"] == ["device memory: NVIDIA H100 of rank 1 has 20.0 GB free, the plan's peak is 60.0 GB: "
                                  "another process holds it (nvidia-smi, rocm-smi), or change the layout "
                                  "(clustertrain plan --search) (on rank 1 (gpu-node1))"]
    assert result["bad_hosts"] == ["gpu-node1"]
