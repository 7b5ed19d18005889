"""A config against a world size, before any rank starts: every problem at once (`clustertrain config check`,
and the trainer's start), with the sizes that would fit."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch.distributed as dist
from helpers import TINY, run_cli

from clustertrain.cli import main
from clustertrain.config.layout import DIMS, ModelShape, apply_layout, check_world, resolve_layout
from clustertrain.config.load import load_config
from clustertrain.distributed.env import RankInfo
from clustertrain.errors import ConfigError
from clustertrain.train.trainer import Trainer

# TINY is a Llama of 2 layers, 4 heads and 2 key/value heads, 8 sequences a step in micro-batches of 4.
FIVE_MISTAKES = {
    "parallel.dp_shard=2": "parallel.dp_shard = 2 shards, but parallel.strategy is ddp",
    "parallel.tp=3": "parallel.tp = 3 does not divide the model's 4 attention heads; use one of [1, 2, 4]",
    "parallel.pp=2": "pipeline parallel: 4 stages for a model of 2 decoder layers",
    "parallel.microbatches=3": "parallel.microbatches = 3 does not divide the 4 sequences each of the 2 data-parallel",
    "train.steps=null": "train: set train.steps, train.tokens or train.epochs",
}
FIVE = ["parallel.strategy=ddp", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2",
        *FIVE_MISTAKES]  # 12 ranks: pp 2 x tp 3 x dp 2


def check(*overrides: str, world: int = 2) -> list[str]:
    """`clustertrain config check --world N` of the tiny model with `overrides`."""
    return ["config", "check", "--world", str(world), *(f"--set={o}" for o in (*TINY, *overrides))]


def test_five_mistakes_are_found_in_one_run(capsys):
    assert main(check(*FIVE, world=12)) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert lines[0] == "error: the default config on 12 rank(s): 5 problems", err
    assert len(lines) == 6 and all(line.startswith("  ") for line in lines[1:]), err
    for message in FIVE_MISTAKES.values():
        assert sum(message in line for line in lines) == 1, f"{message!r} not in\n{err}"


def test_config_check_exits_2_in_a_real_process_and_0_with_the_layout(tmp_path):
    result = run_cli(*check(*FIVE, world=12), timeout=120)
    assert result.returncode == 2 and "5 problems" in result.stderr and "Traceback" not in result.stderr
    config = tmp_path / "per-rank.yaml"
    config.write_text("# nodes: 5, 10, 20\ntrain: {micro_batch_size: 2, grad_accum: 3}\n")
    ok = run_cli("config", "check", str(config), "--nodes", "5", "--set=slurm.tasks_per_node=2", timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == (
        f"OK: {config} on 10 rank(s) (5 node(s) × 2): dp 10 (dp_replicate 10 × dp_shard 1), tp 1, pp 1; micro batch "
        "2 × grad accum 3 × 10 dp ranks = global batch 60 sequences × 128 tokens = 7,680 tokens/step; 300 steps")


def test_a_global_batch_names_the_rank_counts_and_the_form_that_fit():
    problems = check_world(load_config(None, ["train.global_batch_size=16"]), world_size=5)
    assert problems == ["train.global_batch_size = 16 is not divisible by the 5 data-parallel ranks; use a multiple of "
                        "5 (15 or 20), or a data-parallel degree in [1, 2, 4, 8, 16], or the batch per rank "
                        "(train.micro_batch_size × train.grad_accum), which fits any rank count"]


@pytest.mark.parametrize("world", [1, 5, 10, 20, 40])
def test_a_batch_per_rank_fits_any_world_and_resolves_to_a_global_batch(world):
    config = load_config(None, ["train.micro_batch_size=2", "train.grad_accum=4"])
    layout = resolve_layout(config, world)
    assert (layout.global_batch, layout.micro_batch, layout.grad_accum) == (8 * world, 2, 4)
    config = apply_layout(config, layout)
    assert (config.train.global_batch_size, config.train.grad_accum) == (8 * world, None)  # what a resume needs


def test_under_pp_grad_accum_is_the_microbatch_count():
    config = load_config(None, ["parallel.pp=2", "train.micro_batch_size=2", "train.grad_accum=8"])
    layout = resolve_layout(config, 8, shape=ModelShape("llama", 4, 4, 4))
    assert (layout.dp, layout.global_batch, layout.micro_batch, layout.grad_accum) == (4, 64, 2, 8)
    config = apply_layout(config, layout)
    assert config.parallel.microbatches == 8


def test_a_layout_has_a_degree_for_each_dimension_in_order_and_cp_is_one():
    """DIMS is the one list of dimensions. cp has no config key yet: its degree is 1, and the start-up line
    shows it once it is used, beside tp and pp, which it always shows."""
    config = load_config(None, ["parallel.strategy=zero3", "parallel.tp=2", "train.micro_batch_size=1",
                                "train.grad_accum=1"])
    layout = resolve_layout(config, 8)
    assert tuple(layout.degrees) == DIMS == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert [layout.degree(dim) for dim in DIMS] == [1, 1, 4, 1, 2] and layout.dp == 4
    assert layout.describe(128).startswith("dp 4 (dp_replicate 1 × dp_shard 4), tp 2, pp 1; micro batch 1 × ")
    with_cp = dataclasses.replace(layout, world_size=16, degrees={**layout.degrees, "cp": 2})
    assert with_cp.describe(128).startswith("dp 4 (dp_replicate 1 × dp_shard 4), tp 2, cp 2, pp 1; micro batch")


@pytest.mark.parametrize("overrides, world, wrapper", [
    (["parallel.strategy=ddp"], 1, None),  # one rank: nothing to shard or sync, autocast casts
    (["parallel.strategy=zero3"], 1, None),
    (["parallel.strategy=ddp"], 4, "ddp"),
    (["parallel.strategy=zero2"], 4, "fsdp"),
    (["parallel.strategy=hybrid_zero3", "parallel.hybrid_shard_size=2"], 4, "fsdp"),
    (["parallel.strategy=ddp", "parallel.tp=2"], 2, "fsdp"),  # tp: FSDP2 replicates, parameters become DTensors
    (["parallel.strategy=ddp", "parallel.pp=2"], 2, None),
    (["parallel.strategy=ddp", "parallel.pp=2"], 4, "fsdp"),  # the pipeline drives FSDP2's sync itself
])
def test_the_layout_chooses_fsdp_ddp_or_no_wrapper_once(overrides, world, wrapper):
    assert resolve_layout(load_config(None, overrides), world).wrapper == wrapper


@pytest.mark.parametrize("overrides, message", [
    (["parallel.pp=2", "parallel.microbatches=3"],
     "parallel.microbatches = 3 does not divide the 8 sequences each of the 1 data-parallel ranks"),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "train.global_batch_size=10", "parallel.microbatches=5",
      "model.config.num_hidden_layers=4"],
     "parallel.microbatches = 5 is not a multiple of max(1, microbatches // pp) = 2, as interleaved_1f1b needs; use "
     "one of [1, 2, 10]"),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"],
     "pipeline parallel: 4 stages for a model of 2 decoder layers; each stage needs at least one layer"),
    (["parallel.tp=2", "model.arch=gpt2", "model.config={n_embd: 64, n_layer: 2, n_head: 4}"],
     "parallel.tp = 'gpt2' has no tensor-parallel plan (its layers are not plain linears we can split)"),
    (["parallel.pp=2", "model.arch=bloom", "model.config={hidden_size: 64, n_layer: 2, n_head: 4}"],
     "model.arch = 'bloom': pipeline parallel is not supported for it"),
    # transformers ships gemma2's pp plan, but no family file mirrors its forward (logit softcapping)
    (["parallel.pp=2", "model.arch=gemma2", "model.config={hidden_size: 64, intermediate_size: 128, "
      "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16}"],
     "model.arch = 'gemma2': pipeline parallel is not supported for it (clustertrain mirrors the forward of"),
], ids=["microbatches", "interleaved-rounds", "stages-above-layers", "tp-without-a-plan", "pp-without-a-plan",
        "pp-without-a-family"])
def test_layouts_a_model_cannot_take_are_one_line_before_any_rank_starts(capsys, overrides, message):
    """What used to need two real ranks to find (tests/distributed/test_pipeline.py, test_parallel.py)."""
    assert main(check(*overrides)) == 2
    err = capsys.readouterr().err
    header, *problems = err.strip().splitlines()
    assert header.endswith(": 1 problem") and len(problems) == 1 and problems[0].strip().startswith(message), err


def test_training_refuses_every_problem_before_the_process_group_starts(tmp_path):
    config = load_config(None, [*TINY, *FIVE, f"train.run_dir={tmp_path / 'run'}"])
    ranks = RankInfo(0, 12, 0, 12, 0, "127.0.0.1", 29999, "torchrun")
    with pytest.raises(ConfigError) as refused:
        Trainer(config, ranks).run()
    lines = str(refused.value).splitlines()
    assert lines[0] == "5 problems with this config on 12 ranks:" and len(lines) == 6
    assert not dist.is_initialized()
    assert not (tmp_path / "run").exists()  # a refused start touches nothing


def test_two_ranks_refuse_a_config_once_with_every_problem_and_write_nothing(tmp_path):
    """The one real multi-rank start: rank 1 finds the same problems and stays silent; nothing is written."""
    result = run_cli("train", "--nproc", "2", *(f"--set={o}" for o in (
        *TINY, "parallel.pp=2", "parallel.tp=3", "train.steps=null")), cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        "error: 3 problems with this config on 2 ranks:",
        "  parallel.pp × parallel.tp = 2 × 3 does not divide the 2 ranks; use pp × tp in [1, 2], or a multiple of 6 "
        "ranks",
        "  parallel.tp = 3 does not divide the model's 4 attention heads; use one of [1, 2, 4]",
        "  train: set train.steps, train.tokens or train.epochs"], result.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []


def test_a_snapshot_is_checked_from_its_config_json_alone(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 32,
                                                      "num_attention_heads": 32, "num_key_value_heads": 8}))
    assert main(["config", "check", "--world", "16", f"--set=model.path={tmp_path}", "--set=parallel.tp=16"]) == 2
    assert "parallel.tp = 16 does not divide the model's 8 key/value heads; use one of [1, 2, 4, 8]" in \
        capsys.readouterr().err
    assert main(["config", "check", "--world", "16", f"--set=model.path={tmp_path}", "--set=parallel.tp=8"]) == 0
    assert "dp 2 (dp_replicate 2 × dp_shard 1), tp 8, pp 1" in capsys.readouterr().out


def test_world_and_nodes_are_sizes(capsys):
    assert main(["config", "check", "--world", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --world 0: must be at least 1"
    with pytest.raises(SystemExit):
        main(["config", "check"])  # --world or --nodes is required
