"""Pipeline parallelism with real gloo ranks: pp layouts agree with one rank, tied weights stay tied, and
checkpoints move between pp and no pp."""

from __future__ import annotations

import pytest
from helpers import TINY, LayoutRuns, grad_norms, losses, run_cli, train

pytestmark = pytest.mark.dist

STEPS = ["train.steps=4"]
GPT2 = ["model.arch=gpt2", "model.config={n_embd: 64, n_layer: 2, n_head: 4, n_positions: 256, resid_pdrop: 0, "
        "embd_pdrop: 0, attn_pdrop: 0}"]  # GPT-2 ties its head to the embedding; dropout off to compare
DEEP = ["model.config={hidden_size: 64, intermediate_size: 128, num_hidden_layers: 4, num_attention_heads: 4, "
        "num_key_value_heads: 2, max_position_embeddings: 256}"]  # 4 stages of one layer under interleaving
INTERLEAVED = ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.microbatches=4"]
LORA = ["lora.rank=4", "lora.alpha=8", "optim.lr=1e-2", "optim.warmup_steps=0"]
LAYOUTS = {
    "single": dict(nproc=None, overrides=[]),
    "pp2_gpipe": dict(nproc=2, overrides=["parallel.pp=2", "parallel.pp_schedule=gpipe"]),
    "pp2_1f1b": dict(nproc=2, overrides=["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.microbatches=4"]),
    "zero3_dp2_pp2": dict(nproc=4, overrides=["parallel.pp=2", "parallel.strategy=zero3"]),
    "gpt2_single": dict(nproc=None, overrides=GPT2),
    "gpt2_pp2": dict(nproc=2, overrides=[*GPT2, "parallel.pp=2"]),
    "deep_single": dict(nproc=None, overrides=DEEP),
    "deep_pp2_interleaved": dict(nproc=2, overrides=[*DEEP, *INTERLEAVED]),
    "lora_single": dict(nproc=None, overrides=LORA),
    "lora_pp2": dict(nproc=2, overrides=[*LORA, "parallel.pp=2"]),
    "pp2_fp16": dict(nproc=2, overrides=["parallel.pp=2", "parallel.param_dtype=float16"]),
    # the last stage's head computes the loss from labels that travel with the activations
    "pp2_1f1b_chunked": dict(nproc=2, overrides=["parallel.pp=2", "parallel.pp_schedule=1f1b",
                                                 "parallel.microbatches=4", "train.loss=chunked",
                                                 "train.loss_chunk_tokens=100"]),
    "lora_pp2_chunked": dict(nproc=2, overrides=[*LORA, "parallel.pp=2", "train.loss=chunked"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return LayoutRuns(tmp_path_factory, LAYOUTS, *STEPS)



@pytest.mark.parametrize("name, reference", [
    ("pp2_gpipe", "single"), ("pp2_1f1b", "single"), ("zero3_dp2_pp2", "single"), ("gpt2_pp2", "gpt2_single"),
    ("deep_pp2_interleaved", "deep_single"), ("lora_pp2", "lora_single"), ("pp2_1f1b_chunked", "single"),
    ("lora_pp2_chunked", "lora_single"),
])
def test_pipeline_matches_one_rank(runs, name, reference):
    for measure in (losses, grad_norms):
        expected, got = measure(runs[reference]), measure(runs[name])
        for step in range(1, 5):
            assert got[step] == pytest.approx(expected[step], rel=1e-5), f"{measure.__name__}, step {step}"


def test_pipeline_fp16_scales_the_loss_and_tracks_fp32(runs):
    from clustertrain.train.metrics import read_jsonl

    reference, got = losses(runs["single"]), losses(runs["pp2_fp16"])
    for step in range(1, 5):
        assert got[step] == pytest.approx(reference[step], rel=2e-2), f"step {step}"
    assert got[1] != reference[1], "half-precision compute should not be bit-identical to fp32"
    scales = [r["loss_scale"] for r in read_jsonl(runs["pp2_fp16"] / "metrics.jsonl") if "loss" in r]
    assert len(scales) == 4 and scales[0] == 2.0**16


@pytest.mark.parametrize("model, reference", [([], "single"), (GPT2, "gpt2_single"), (LORA, "lora_single")])
def test_pipeline_checkpoint_resumes_on_one_rank(runs, tmp_path, model, reference):
    train(tmp_path, *STEPS, *model, "parallel.pp=2", "train.stop_after_steps=2", nproc=2)
    train(tmp_path, *STEPS, *model)
    assert sorted(losses(tmp_path)) == [1, 2, 3, 4]
    assert losses(tmp_path) == pytest.approx(losses(runs[reference]), rel=1e-5)


def test_one_rank_checkpoint_resumes_under_pipeline(runs, tmp_path):
    # tied: the last stage reads its head's optimizer state from the embedding's, the name one rank saves
    train(tmp_path, *STEPS, *GPT2, "train.stop_after_steps=2")
    train(tmp_path, *STEPS, *GPT2, "parallel.pp=2", nproc=2)
    assert losses(tmp_path) == pytest.approx(losses(runs["gpt2_single"]), rel=1e-5)


def test_pipeline_lora_checkpoint_exports_an_adapter(runs, tmp_path):
    # peft's names under pp too: export sees the same checkpoint as from a run without pp
    result = run_cli("export", str(runs["lora_pp2"]), str(tmp_path / "adapter"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    assert (tmp_path / "adapter" / "adapter_config.json").exists()


@pytest.mark.parametrize("overrides, message", [
    (["parallel.microbatches=3"], "error: parallel.microbatches = 3 does not divide the 8 sequences"),
    (["parallel.pp_schedule=interleaved_1f1b", "train.global_batch_size=10", "parallel.microbatches=5"],
     "error: parallel.microbatches = 5 is not a multiple of max(1, microbatches // pp) = 2"),
    (["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"],
     "error: pipeline parallel: 4 stages for a model of 2 decoder layers"),
])
def test_unsupported_pipeline_settings_are_one_line(tmp_path, overrides, message):
    result = run_cli("train", "--nproc", "2", *(f"--set={o}" for o in (
        *TINY, f"train.run_dir={tmp_path}", "parallel.pp=2", *overrides)))
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr
    assert "Traceback" not in result.stderr
