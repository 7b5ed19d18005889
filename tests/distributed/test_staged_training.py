"""A folder `clustertrain stage dataset` wrote is a training source (`path: OUT`): 2 ranks train on it, stop, and
resume to the losses and samples of a run never stopped; a partial stage refuses to start in one line."""

from __future__ import annotations

import json
import random

import pytest
from helpers import losses, train

from clustertrain.cli import main
from clustertrain.data.audit import read_audit
from clustertrain.data.staged import MANIFEST

pytestmark = pytest.mark.dist

STEPS = 6


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """A stage of 300 of a local dataset's 400 rows, in shards of 64."""
    root = tmp_path_factory.mktemp("stage")
    rng = random.Random(3)
    words = ["the", "river", "sang", "def", "return", "slowly", "import", "42"]
    (root / "hub").mkdir()
    for f in range(2):
        with (root / "hub" / f"{f}.jsonl").open("w") as out:
            for _ in range(200):
                text = " ".join(rng.choice(words) for _ in range(rng.randint(5, 80)))
                out.write(json.dumps({"content": text}) + "\n")
    out = root / "web"
    assert main(["stage", "dataset", str(root / "hub"), str(out), "--text-field", "content", "--max-rows", "300",
                 "--shard-rows", "64"]) == 0
    return out


def test_a_staged_folder_trains_and_resumes_exactly(staged, tmp_path):
    overrides = [f"data.sources=[{{path: {staged}}}]", "data.shuffle_buffer=16", "data.audit=true",
                 f"train.steps={STEPS}"]
    uninterrupted = tmp_path / "a"
    train(uninterrupted, *overrides, nproc=2)
    interrupted = tmp_path / "b"
    train(interrupted, *overrides, "train.stop_after_steps=3", nproc=2)
    train(interrupted, *overrides, nproc=2)
    assert read_audit(interrupted / "samples.jsonl") == read_audit(uninterrupted / "samples.jsonl")
    assert losses(interrupted) == losses(uninterrupted) and sorted(losses(uninterrupted)) == list(range(1, STEPS + 1))
    sources = {sample[0] for step in read_audit(uninterrupted / "samples.jsonl").values() for sample in step}
    assert sources == {"web"}  # the folder's name labels the source


def test_a_partial_stage_refuses_to_train_in_one_line(staged, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    for path in staged.iterdir():
        (partial / path.name).write_bytes(path.read_bytes())
    manifest = json.loads((partial / MANIFEST).read_text())
    manifest["complete"] = False
    (partial / MANIFEST).write_text(json.dumps(manifest))
    result = train(tmp_path / "run", f"data.sources=[{{path: {partial}}}]", expect=2)
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: data source {str(partial)!r} is a partial stage (5 shards, 300 rows so far): finish it by running "
        f"`{manifest['command']}` again")
