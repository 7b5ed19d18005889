"""A run settled on a world it is not running in: what `config show --world` prints and what a planner builds,
through the entry the trainer calls, with no process group and no run directory; under `parallel.strategy: auto`
the layout the planner chose, named."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from helpers import TINY, write_tiny_repo

from pydantic import ValidationError

from clustertrain.cli import main
from clustertrain.config.layout import resolve_layout
from clustertrain.config.load import dump_config
from clustertrain.model.build import build_model
from clustertrain.parallel.apply import DTYPES
from clustertrain.plan.auto import LayoutChoice
from clustertrain.resolve.load import load_checked_config
from clustertrain.resolve.run import resolve


def test_a_fine_tuning_run_is_resolved_and_built_for_16_ranks_without_a_process_group(tmp_path, monkeypatch):
    write_tiny_repo(tmp_path / "model")
    monkeypatch.chdir(tmp_path)  # a relative model.path, as users write it
    per_rank = [o for o in TINY if not o.startswith("train.global_batch_size")]  # the batch given per rank instead
    config = load_checked_config(None, [*per_rank, "model.path=model", "lora.rank=4", "parallel.strategy=hybrid_zero3",
                                        "train.grad_accum=2", "train.steps=3",
                                        f"train.run_dir={tmp_path / 'run'}"])
    before = dump_config(config)
    run = resolve(config, world_size=16, local_world_size=4, device_type="cpu")
    assert not dist.is_initialized() and not (tmp_path / "run").exists()
    assert dump_config(config) == before, "the given config is not written"

    layout, resolved = run.layout, run.config
    assert (layout.degree("dp_replicate"), layout.degree("dp_shard"), layout.degree("tp"), layout.degree("pp")) == (4, 4, 1, 1)
    assert (layout.micro_batch, layout.grad_accum, layout.global_batch) == (4, 2, 128)
    assert (resolved.train.global_batch_size, resolved.train.grad_accum) == (128, None)  # as config.yaml keeps it
    assert resolved.model.path == os.path.join(tmp_path, "model") == str(run.snapshot)
    assert resolved.data.tokenizer == str(run.snapshot)  # fine-tuning reads the model's own tokenizer
    assert resolved.parallel.param_dtype == "float32"  # auto, on a CPU
    with pytest.raises(ValidationError, match="frozen"):  # read, never written: every component sees the same
        resolved.train.steps = 4

    built = build_model(resolved.model, resolved.lora, None, resolved.data.vocab_size,
                        param_dtype=DTYPES[resolved.parallel.param_dtype], device="cuda",
                        loss=resolved.train.loss, loss_chunk_tokens=resolved.train.loss_chunk_tokens,
                        tp=layout.degree("tp"), pipeline=layout.degree("pp") > 1, packed_documents=resolved.data.packed_documents)
    assert not dist.is_initialized()
    assert (built.hf_config.vocab_size, built.hf_config.hidden_size) == (128, 64)  # the snapshot's, model.config on top
    trainable = [name for name, p in built.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert all(p.is_meta for p in built.model.parameters())


def test_config_show_prints_the_config_a_run_on_that_world_resolves(capsys):
    assert main(["config", "show", "--world", "4", "--set", "train.micro_batch_size=2",
                 "--set", "train.grad_accum=3"]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.startswith("# the default config on 4 rank(s): dp 4 (dp_replicate 4 × dp_shard 1)")
    assert "micro batch 2 × grad accum 3 × 4 dp ranks = global batch 24 sequences" in header
    assert "  global_batch_size: 24" in lines and "  grad_accum: null" in lines
    assert main(["config", "show", "--world", "3", "--set", "parallel.tp=2"]) == 2


def test_strategy_auto_settles_on_the_layout_the_planner_chose_and_names_it():
    config = load_checked_config(None, [*TINY, "parallel.strategy=auto"])
    run = resolve(config, world_size=2, local_world_size=2, device_type="cpu")
    assert not dist.is_initialized()  # the planner's fake rank is gone

    chosen = run.config.parallel
    assert isinstance(run.choice, LayoutChoice) and chosen.strategy != "auto"
    assert run.choice.line.startswith(f"parallel.strategy auto chose {chosen.strategy}, ")
    assert f"micro batch {run.layout.micro_batch}, checkpointing {chosen.activation_checkpoint}:" in run.choice.line
    assert {key: getattr(chosen, key) for key in run.choice.overrides["parallel"]} == run.choice.overrides["parallel"]
    assert (chosen.tp, chosen.pp) == (run.layout.degree("tp"), run.layout.degree("pp"))
    assert resolve_layout(run.config, 2, 2) == run.layout, "the settled config lays out as its layout"
    assert run.param_dtype == "float32" and run.device_type == "cpu"

    fixed = resolve(load_checked_config(None, [*TINY, "parallel.strategy=zero3"]), 2, 2, "cpu")
    assert fixed.choice is None  # a configured layout is checked, not chosen


@pytest.mark.parametrize("version, pp, refused", [("4.57.6", 2, True), ("4.57.6", 1, False), ("5.0.0", 2, False)])
def test_pipeline_stages_under_transformers_4_are_one_line(version, pp, refused):
    from clustertrain.errors import ConfigError
    from clustertrain.resolve.packages import check_pipeline_transformers

    config = load_checked_config(None, [*TINY, f"parallel.pp={pp}"])
    if not refused:
        check_pipeline_transformers(config, version)
        return
    with pytest.raises(ConfigError, match=r"^parallel.pp = 2 needs transformers 5 or newer \(installed: 4.57.6\)"):
        check_pipeline_transformers(config, version)
