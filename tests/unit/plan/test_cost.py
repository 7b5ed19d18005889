"""What a step costs (clustertrain.plan.cost), planned through the run's own build path on a fake world."""

from __future__ import annotations

import pytest
from helpers import TINY

from clustertrain.plan.cost import Device
from clustertrain.plan.plan import make_plan
from clustertrain.resolve.load import load_checked_config
from clustertrain.resolve.run import resolve

DEVICE = Device("test", memory_bytes=None, peak_flops=1e12, intra_node_bps=1e9, inter_node_bps=1e9, per_node=8)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_tp_splits_the_head_s_flops_with_the_rest_of_the_model(lora):
    """With the head split by vocabulary rows each tp rank computes 1/tp of it, like every other matmul: a rank at
    tp 2 computes half of what one rank computes (the head of this 8,192-token vocabulary is 5/6 of the model's
    FLOPs: counted whole on each tp rank, it would be 11/12)."""
    common = [*TINY, "data.vocab_size=8192", "parallel.param_dtype=float32", "train.global_batch_size=4",
              "train.micro_batch_size=4", *(["lora.rank=4"] if lora else [])]
    flops = {}
    for tp in (1, 2):
        run = resolve(load_checked_config(None, [*common, f"parallel.tp={tp}"]), tp, tp, "cpu")
        flops[tp] = make_plan(run.config, run.layout, per_node=8, device=DEVICE).flops_per_rank
    assert flops[2] == pytest.approx(flops[1] / 2, rel=1e-12)
