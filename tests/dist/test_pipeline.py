"""Pipeline parallelism with real gloo ranks: pp layouts agree with one rank, tied weights stay tied, and
checkpoints move between pp and no pp."""

from __future__ import annotations

import pytest
from helpers import TINY, LayoutRuns, grad_norms, losses, run_cli, train


pytestmark = pytest.mark.dist

STEPS = ["train.steps=4"]
GPT2 = ["model.arch=gpt2", "model.config={n_embd: 64, n_layer: 2, n_head: 4, n_positions: 256, resid_pdrop: 0, "
        "embd_pdrop: 0, attn_pdrop: 0}"]  # GPT-2 ties its head to the embedding; dropout off to compare
LAYOUTS = {
    "single": dict(nproc=None, overrides=[]),
    "pp2_gpipe": dict(nproc=2, overrides=["parallel.pp=2", "parallel.pp_schedule=gpipe"]),
    "pp2_1f1b": dict(nproc=2, overrides=["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.microbatches=4"]),
    "zero3_dp2_pp2": dict(nproc=4, overrides=["parallel.pp=2", "parallel.strategy=zero3"]),
    "gpt2_single": dict(nproc=None, overrides=GPT2),
    "gpt2_pp2": dict(nproc=2, overrides=[*GPT2, "parallel.pp=2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return LayoutRuns(tmp_path_factory, LAYOUTS, *STEPS)



@pytest.mark.parametrize("name, reference", [
    ("pp2_gpipe", "single"), ("pp2_1f1b", "single"), ("zero3_dp2_pp2", "single"), ("gpt2_pp2", "gpt2_single"),
])
def test_pipeline_matches_one_rank(runs, name, reference):
    for measure in (losses, grad_norms):
        expected, got = measure(runs[reference]), measure(runs[name])
        for step in range(1, 5):
            assert got[step] == pytest.approx(expected[step], rel=1e-5), f"{measure.__name__}, step {step}"


@pytest.mark.parametrize("model, reference", [([], "single"), (GPT2, "gpt2_single")])
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


@pytest.mark.parametrize("overrides, message", [
    (["parallel.pp_schedule=interleaved_1f1b"],
     "error: parallel.pp_schedule = 'interleaved_1f1b' is not available yet"),
    (["parallel.microbatches=3"], "error: parallel.microbatches = 3 does not divide the 8 sequences"),
    (["lora.rank=4"], "error: lora with parallel.pp > 1 is not available yet"),
])
def test_unsupported_pipeline_settings_are_one_line(tmp_path, overrides, message):
    result = run_cli("train", "--nproc", "2", *(f"--set={o}" for o in (
        *TINY, f"train.run_dir={tmp_path}", "parallel.pp=2", *overrides)))
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr
    assert "Traceback" not in result.stderr
