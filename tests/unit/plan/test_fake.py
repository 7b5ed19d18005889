"""The byte counting and the traffic model of `clustertrain plan`, in-process."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
from helpers import TINY
from torch._subclasses.fake_tensor import FakeTensorMode

from clustertrain.config.checks import Layout
from clustertrain.model.spec import load_checked_config
from clustertrain.plan.cost import inside_node, traffic
from clustertrain.plan.fake import LiveBytes


def test_live_bytes_counts_a_storage_once_until_it_is_freed_and_follows_resize():
    with FakeTensorMode(), LiveBytes() as counted:
        x = torch.empty(1000)
        views = x.view(10, 100), x[:10]  # views share x's storage
        assert counted.live == 4000
        y = x * 2
        assert counted.live == 8000
        del y, views, x
        gc.collect()
        assert counted.live == 0 and counted.peak == 8000
        z = torch.empty(256)
        z.untyped_storage().resize_(0)  # how FSDP frees a gathered parameter
        assert counted.live == 0
        z.untyped_storage().resize_(2048)
        assert counted.live == 2048


def layout(**sizes) -> Layout:
    base = {"world_size": 1, "pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1, "global_batch": 8, "micro_batch": 4,
            "grad_accum": 1, "wrapper": "fsdp"}
    base.update(sizes)
    base["world_size"] = base["pp"] * base["dp_replicate"] * base["dp_shard"] * base["tp"]
    return Layout(**base)


def test_a_group_is_inside_a_node_while_its_span_of_ranks_fits_one():
    big = layout(dp_replicate=4, dp_shard=2, tp=4)
    assert inside_node(big, "tp", 8) and inside_node(big, "dp_shard", 8)  # 4, then 8 adjacent ranks
    assert not inside_node(big, "dp_replicate", 8)  # 32 ranks: 4 nodes
    assert not inside_node(big, "dp_shard", 4)


@pytest.mark.parametrize("strategy, gathers", [("zero3", 2), ("zero2", 1)])
def test_fsdp_sends_its_shard_to_each_peer_per_gather_and_reduce_scatter(strategy, gathers):
    config = load_checked_config(None, [*TINY, f"parallel.strategy={strategy}", "parallel.param_dtype=bfloat16"])
    shard = 1000  # float32 bytes of this rank's shard; gathered in bfloat16, reduced in float32
    sent = traffic(config, layout(dp_shard=4), shard, shard, 2, hidden=64, layers=2, per_node=8)
    assert sent.bytes == {"dp_shard": gathers * 3 * shard / 2 + 3 * shard}
    assert sent.inside_node == {"dp_shard": True}
    hybrid = traffic(config, layout(dp_replicate=2, dp_shard=4), shard, shard, 2, hidden=64, layers=2, per_node=4)
    assert hybrid.bytes["dp_replicate"] == 2 * (1 / 2) * shard and hybrid.inside_node["dp_replicate"] is False


def test_tensor_parallel_all_reduces_activations_four_times_a_block_six_with_recompute():
    config = load_checked_config(None, [*TINY, "parallel.strategy=zero3", "parallel.activation_checkpoint=full"])
    sent = traffic(config, layout(tp=2, wrapper=None), 0, 0, 4, hidden=64, layers=2, per_node=8)
    activation = 4 * 64 * 64 * 4  # micro batch 4 × seq 64 × hidden 64, float32
    assert sent.bytes == {"tp": 2 * 6 * 2 * (1 / 2) * activation}


def test_a_target_without_a_world_is_refused_in_one_line():
    from clustertrain.errors import UserError
    from clustertrain.plan.target import target_for

    config = load_checked_config(None, TINY)
    args = SimpleNamespace(world=None, nodes=None, gpus_per_node=None, preset=None, device_memory=None,
                           peak_tflops=None, efficiency=0.5)
    with pytest.raises(UserError, match="--world N"):
        target_for(config, args)


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_a_deep_model_planned_from_two_short_depths_matches_it_stepped_whole(monkeypatch, checkpointing):
    from clustertrain.plan import plan
    from clustertrain.train.resolve import resolve_run

    config = load_checked_config(None, [*TINY, "parallel.strategy=zero3", "model.config.num_hidden_layers=20",
                                        f"parallel.activation_checkpoint={checkpointing}",
                                        "parallel.param_dtype=float32"])
    run = resolve_run(config, 4, 4, None)
    grown = plan.measure_stage(run.config, run.layout, 0)
    monkeypatch.setattr(plan, "DIRECT_LAYERS", 100)
    whole = plan.measure_stage(run.config, run.layout, 0)
    for key in ("params", "trainable", "grads", "optimizer", "checkpoint", "flops_per_token", "layers"):
        assert getattr(grown, key) == pytest.approx(getattr(whole, key), rel=1e-12), key
    assert grown.peak == pytest.approx(whole.peak, rel=0.02) and grown.activations == pytest.approx(
        whole.activations, rel=0.02)


def test_search_ranks_the_layouts_that_fit_fastest_first_and_draws_them(tmp_path, capsys):
    import json

    from clustertrain.cli import main

    picture = tmp_path / "plan.png"
    code = main(["plan", "--world", "2", "--search", "--json", "--peak-tflops", "1", "--plot", str(picture),
                 *[f"--set={o}" for o in TINY]])
    ranked = json.loads(capsys.readouterr().out)
    assert code == 0 and len(ranked) > 1 and all(choice["fits"] for choice in ranked)
    speeds = [choice["tokens_per_s"] for choice in ranked]
    assert speeds == sorted(speeds, reverse=True) and speeds[-1] > 0
    assert len({json.dumps(choice["overrides"], sort_keys=True) for choice in ranked}) == len(ranked)
    assert picture.stat().st_size > 10_000


@pytest.mark.parametrize("argv, says", [(["--world", "0"], "--world"), (["--world", "2", "--preset", "nowhere"],
                                                                         "slurm.preset")])
def test_a_bad_plan_argument_is_one_line_and_exit_2(capsys, argv, says):
    from clustertrain.cli import main

    assert main(["plan", *argv, *[f"--set={o}" for o in TINY]]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("schedule, held", [("gpipe", [4, 4]), ("1f1b", [2, 1]), ("interleaved_1f1b", [5, 3])])
def test_a_pipeline_rank_holds_the_microbatches_its_schedule_keeps_in_flight(schedule, held):
    from clustertrain.plan.fake import microbatches_in_flight

    config = load_checked_config(None, [*TINY, "parallel.pp=2", f"parallel.pp_schedule={schedule}",
                                        "parallel.microbatches=4", "model.config.num_hidden_layers=4"])
    pipeline = layout(pp=2, dp_shard=1, grad_accum=4, micro_batch=1, wrapper=None)
    assert [microbatches_in_flight(config, pipeline, stage) for stage in (0, 1)] == held
    # and the plan of a pipeline rank holds that many microbatches' activations
    from clustertrain.plan.plan import measure_stage
    from clustertrain.train.resolve import resolve_run

    run = resolve_run(config, 2, 2, "cpu")
    first, last = (measure_stage(run.config, run.layout, rank) for rank in (0, 1))
    assert first.activations > 0 and last.activations > 0


def test_the_activations_follow_the_attention_kernel():
    """sdpa masks packed documents with a [rows, 1, seq, seq] mask and keeps it for the backward; flash-attn and
    flex keep no seq x seq tensor (planned on the CPU as sdpa without a mask, which keeps none either)."""
    from clustertrain.plan.fake import fake_world, measure_rank
    from clustertrain.train.resolve import resolve_run

    kept = {}
    for attention in ("sdpa", "flash_attention_2", "flex_attention"):
        config = load_checked_config(None, [*TINY, "data.seq_len=512", "data.doc_masking=true",
                                            "model.config.max_position_embeddings=512",
                                            f"model.attn_implementation={attention}"])
        run = resolve_run(config, 1, 1, None)
        with fake_world(1, 0):
            kept[attention] = measure_rank(run.config.updated(parallel={"param_dtype": "float32"}), run.layout)
    rows, seq = 4, 512
    assert kept["sdpa"].activations - kept["flash_attention_2"].activations >= rows * seq * seq
    assert kept["flash_attention_2"] == kept["flex_attention"]
