"""The byte counting and the traffic model of `clustertrain plan`, in-process."""

from __future__ import annotations

import gc
import math

import pytest
import torch
from helpers import TINY
from torch._subclasses.fake_tensor import FakeTensorMode

from clustertrain.config.layout import DIMS, Layout
from clustertrain.plan.cost import inside_node, traffic
from clustertrain.plan.fake import LiveBytes
from clustertrain.resolve.load import load_checked_config


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


def layout(**fields) -> Layout:
    degrees = {dim: fields.pop(dim, 1) for dim in DIMS}
    batch = {"global_batch": 8, "micro_batch": 4, "grad_accum": 1, "wrapper": "fsdp", **fields}
    return Layout(math.prod(degrees.values()), degrees, **batch)


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
    from clustertrain.plan.target import TargetRequest, target_for

    config = load_checked_config(None, TINY)
    with pytest.raises(UserError, match="--world N"):
        target_for(config, TargetRequest(efficiency=0.5))


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective", "every_n"])
def test_a_deep_model_planned_from_two_short_depths_matches_it_stepped_whole(monkeypatch, checkpointing):
    from clustertrain.plan import plan
    from clustertrain.resolve.run import resolve

    config = load_checked_config(None, [*TINY, "parallel.strategy=zero3", "model.config.num_hidden_layers=20",
                                        f"parallel.activation_checkpoint={checkpointing}",
                                        "parallel.param_dtype=float32"])
    run = resolve(config, 4, 4, None)
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


FLAG_RANGE = "it must be above 0 and at most"
BAD_ARGUMENTS = {
    "no ranks": (["--world", "0"], "error: plan: --world is 0; it must be at least 1 (ranks)"),
    "no nodes": (["--nodes", "0"], "error: plan: --nodes is 0; it must be at least 1 (nodes)"),
    "no ranks per node": (["--nodes", "2", "--gpus-per-node", "-8"], "error: plan: --gpus-per-node is -8;"),
    "an unknown preset": (["--world", "2", "--preset", "nowhere"], "slurm.preset"),
    "negative memory": (["--world", "2", "--device-memory", "-1"],
                        f"error: plan: --device-memory is -1.0; {FLAG_RANGE} 1,000,000 (GB of device memory per rank)"),
    "infinite memory": (["--world", "2", "--device-memory", "inf"], "--device-memory is inf;"),
    "efficiency 5": (["--world", "2", "--efficiency", "5"], f"error: plan: --efficiency is 5.0; {FLAG_RANGE} 1 (the "
                     "fraction of the peak FLOP/s the matmuls reach)"),
    "efficiency nan": (["--world", "2", "--efficiency", "nan"], "--efficiency is nan;"),
    "efficiency 0": (["--world", "2", "--efficiency", "0"], "--efficiency is 0.0;"),
    "no peak": (["--world", "2", "--peak-tflops", "0"], f"error: plan: --peak-tflops is 0.0; {FLAG_RANGE} 1,000,000"),
    "a peak past a float": (["--world", "2", "--peak-tflops", "1e999"], "--peak-tflops is inf;"),
}


@pytest.mark.parametrize("argv, says", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_a_bad_plan_argument_is_one_line_and_exit_2(capsys, argv, says):
    from clustertrain.cli import main

    assert main(["plan", *argv, *[f"--set={o}" for o in TINY]]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_a_plot_that_cannot_be_written_is_one_line_and_exit_2(tmp_path, capsys):
    from clustertrain.cli import main

    (tmp_path / "taken").write_text("a file where the folder should be")
    for picture, says in ((tmp_path / "taken" / "plan.png", f"(File exists: {tmp_path / 'taken'})"),
                          (tmp_path / "plan.xyz", "Format 'xyz' is not supported")):
        code = main(["plan", "--world", "2", "--peak-tflops", "1", "--plot", str(picture),
                     *[f"--set={o}" for o in TINY]])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith(f"error: plan --plot: cannot write {picture}") and says in err, err
        assert err.count("\n") == 1 and not picture.exists()


@pytest.mark.parametrize("schedule, held", [("gpipe", [4, 4]), ("1f1b", [2, 1]), ("interleaved_1f1b", [5, 3])])
def test_a_pipeline_rank_holds_the_microbatches_its_schedule_keeps_in_flight(schedule, held):
    from clustertrain.plan.fake import microbatches_in_flight

    config = load_checked_config(None, [*TINY, "parallel.pp=2", f"parallel.pp_schedule={schedule}",
                                        "parallel.microbatches=4", "model.config.num_hidden_layers=4"])
    pipeline = layout(pp=2, dp_shard=1, grad_accum=4, micro_batch=1, wrapper=None)
    assert [microbatches_in_flight(config, pipeline, stage) for stage in (0, 1)] == held
    # and the plan of a pipeline rank holds that many microbatches' activations
    from clustertrain.plan.plan import measure_stage
    from clustertrain.resolve.run import resolve

    run = resolve(config, 2, 2, "cpu")
    first, last = (measure_stage(run.config, run.layout, rank) for rank in (0, 1))
    assert first.activations > 0 and last.activations > 0


def test_the_activations_follow_the_attention_kernel():
    """sdpa masks packed documents with a [rows, 1, seq, seq] mask and keeps it for the backward; flash-attn and
    flex keep no seq x seq tensor (planned on the CPU as sdpa without a mask, which keeps none either)."""
    from clustertrain.plan.fake import fake_world, measure_rank
    from clustertrain.resolve.run import resolve

    kept = {}
    for attention in ("sdpa", "flash_attention_2", "flex_attention"):
        config = load_checked_config(None, [*TINY, "data.seq_len=512", "data.doc_masking=true",
                                            "model.config.max_position_embeddings=512",
                                            f"model.attn_implementation={attention}"])
        run = resolve(config, 1, 1, None)
        with fake_world(1, 0):
            kept[attention] = measure_rank(run.config.updated(parallel={"param_dtype": "float32"}), run.layout)
    rows, seq = 4, 512
    assert kept["sdpa"].activations - kept["flash_attention_2"].activations >= rows * seq * seq
    assert kept["flash_attention_2"] == kept["flex_attention"]


@pytest.mark.parametrize("schedule, stages_per_rank", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_a_pipeline_s_planned_step_is_its_compute_stretched_by_the_bubble(schedule, stages_per_rank):
    """1F1B idles (pp - 1) / (m + pp - 1) of a step, m its microbatches (interleaved: divided by the stages per
    rank), so the planned step is the compute over the share it is busy, plus the activations pp sends."""
    from clustertrain.plan.cost import Device
    from clustertrain.plan.plan import make_plan
    from clustertrain.resolve.run import resolve

    pp, m = 2, 4
    config = load_checked_config(None, [*TINY, f"parallel.pp={pp}", f"parallel.pp_schedule={schedule}",
                                        f"parallel.microbatches={m}", "model.config.num_hidden_layers=4",
                                        "parallel.param_dtype=float32"])
    run = resolve(config, pp, pp, "cpu")
    assert (run.layout.grad_accum, run.layout.micro_batch) == (m, 2)  # global batch 8 in 4 microbatches of 2
    device = Device("test", memory_bytes=None, peak_flops=1e12, intra_node_bps=1e9, inter_node_bps=1e9, per_node=8,
                    efficiency=0.5)
    plan = make_plan(run.config, run.layout, per_node=8, device=device)
    idle = (pp - 1) / stages_per_rank / (m + pp - 1)  # 1/5 of the step, 1/10 interleaved over two stages a rank
    assert plan.bubble == pytest.approx(idle, rel=1e-12)
    compute = plan.stages[0].flops_per_token * 8 * 64 / pp / (1e12 * 0.5)  # global batch 8 × seq 64 over 2 ranks
    assert plan.compute_s == pytest.approx(compute, rel=1e-12)
    sent = 2 * m * 2 * 64 * 64 * 4  # activations out and gradients back: m microbatches of 2 × 64 × hidden 64, fp32
    assert plan.comm_s == pytest.approx({"pp": sent / 1e9}, rel=1e-12)
    assert plan.step_s == pytest.approx(compute / (1 - idle) + sent / 1e9, rel=1e-12)


def test_ddp_s_planned_peak_holds_a_bucket_copy_of_every_trainable_parameter():
    """DDP all-reduces its gradients through buckets as large as the trainable parameters: a full fine-tune's
    peak is a single rank's (same rows per rank, no wrapper) plus one float32 copy of the model. (LoRA's buckets
    are a rounding error; a full model's are a quarter of its steady state.)"""
    from clustertrain.plan.fake import fake_world, measure_rank
    from clustertrain.resolve.run import resolve

    common = [*TINY, "parallel.param_dtype=float32", "train.micro_batch_size=4"]
    ddp = resolve(load_checked_config(None, [*common, "parallel.strategy=ddp", "train.global_batch_size=8"]),
                      2, 2, None)
    alone = resolve(load_checked_config(None, [*common, "train.global_batch_size=4"]), 1, 1, None)
    assert ddp.layout.wrapper == "ddp" and alone.layout.wrapper is None
    assert ddp.layout.micro_batch * ddp.layout.grad_accum == alone.layout.micro_batch * alone.layout.grad_accum
    with fake_world(2, 0):
        replica = measure_rank(ddp.config, ddp.layout)
    with fake_world(1, 0):
        single = measure_rank(alone.config, alone.layout)
    model_bytes = 4 * sum(p.numel() for p in build_tiny_model().parameters())
    assert replica.params == replica.trainable == single.params == model_bytes
    assert replica.buckets == model_bytes and single.buckets == 0
    assert replica.peak - single.peak == model_bytes, (replica, single)


def build_tiny_model():
    """TINY's Llama as transformers builds it (on the meta device): the parameters a plan must count."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      vocab_size=512)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)
