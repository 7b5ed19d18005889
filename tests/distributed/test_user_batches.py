"""The batches users bring: a per-rank batch with gradient accumulation, and a corpus of one example per line."""

from __future__ import annotations

import json

import pytest
import yaml
from helpers import TINY, losses, run_cli, train

pytestmark = pytest.mark.dist

NO_GLOBAL = [o for o in TINY if not o.startswith(("train.global_batch_size", "train.micro_batch_size"))]


def test_grad_accum_makes_the_global_batch_from_the_rank_count(tmp_path):
    accum = tmp_path / "accum"
    result = run_cli("train", "--nproc", "2", *(f"--set={o}" for o in (
        *NO_GLOBAL, f"train.run_dir={accum}", "train.steps=3", "train.micro_batch_size=2", "train.grad_accum=2")))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "batch: 8 seq x 64 tokens" in result.stdout  # 2 rows x 2 micro-batches x 2 ranks
    saved = yaml.safe_load((accum / "config.yaml").read_text())["train"]
    assert (saved["global_batch_size"], saved["grad_accum"]) == (8, None)  # what a resume needs
    train(tmp_path / "global", "train.steps=3", "train.micro_batch_size=2", nproc=2)  # TINY's global batch: 8
    assert losses(accum) == pytest.approx(losses(tmp_path / "global"), rel=1e-6)


@pytest.mark.parametrize("text_unit", ["line", "file"])
def test_a_corpus_of_one_example_per_line_gives_distinct_rows_on_two_ranks(tmp_path, text_unit):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"example {i}: " + " ".join(f"w{(i * 7 + j) % 41}" for j in range(40)) + "\n"
                              for i in range(20)))
    result = train(tmp_path / "run", "train.steps=2", f"data.sources=[{{path: {corpus}, text_unit: {text_unit}}}]",
                   "data.audit=true", "data.vocab_size=300", nproc=2)
    for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines():
        samples = json.loads(line)["samples"]
        assert len({tuple(s) for s in samples}) == 8, samples
    said = "1 training document(s) for the 8 rows of a global batch" in result.stdout
    assert said == (text_unit == "file"), result.stdout


def test_an_epoch_resumed_mid_way_on_another_rank_count_repeats_nothing(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: " + " ".join(f"w{(i * 11 + j) % 53}" for j in range(30)) + "\n"
                              for i in range(64)))
    run_dir = tmp_path / "run"
    common = ("train.epochs=1", f"data.sources=[{{path: {corpus}, text_unit: line}}]", "data.eval_fraction=0",
              "data.audit=true", "data.vocab_size=300", "checkpoint.every=1")
    first = train(run_dir, *common, "train.stop_after_steps=2", nproc=2)
    steps = int(first.stdout.split(" epochs of ")[1].split(" steps")[0])
    assert steps > 2 and "counting the sequences of one pass" in first.stdout
    second = train(run_dir, *common)  # one rank now; the first start's count is kept in the run directory
    assert "counting" not in second.stdout and f" epochs of {steps} steps" in second.stdout
    samples = [tuple(s) for line in (run_dir / "samples.jsonl").read_text().splitlines()
               for s in json.loads(line)["samples"]]
    assert len(samples) == 8 * steps and len(set(samples)) == len(samples)
    assert max(losses(run_dir)) == steps
    assert run_cli("data", "audit", str(run_dir)).returncode == 0
