"""Sample identities of every global batch survive interruptions and changes of rank count (real runs), and
`clustertrain data audit` finds a repeated, skipped or unexpected sample when there is one."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from helpers import train

from clustertrain.cli import main
from clustertrain.data.audit import read_audit

pytestmark = pytest.mark.dist

STEPS = 8


def write_sources(root):
    rng = random.Random(0)
    for name, words in (("code", ["def", "return", "class", "import"]), ("prose", ["the", "river", "sang", "slowly"])):
        with (root / f"{name}.jsonl").open("w") as f:
            for i in range(400):
                f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(5, 60)))}) + "\n")
    with (root / "sft.jsonl").open("w") as f:
        for i in range(300):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            f.write(json.dumps({"prompt": f"What is {a} plus {b}? ", "completion": f"{a + b}"}) + "\n")


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_sources(root)
    return root


def mixture(root):
    return [f"data.sources=[{{path: {root / 'code.jsonl'}, weight: 3}}, {{path: {root / 'prose.jsonl'}}}]",
            "data.shuffle_buffer=16", "data.audit=true", f"train.steps={STEPS}"]


def sft(root):
    return [f"data.sources=[{{path: {root / 'sft.jsonl'}}}]", "data.mode=sft", "data.audit=true",
            f"train.steps={STEPS}"]


def audit(run_dir, capsys) -> tuple[int, list[str]]:
    """(exit code, output lines) of `clustertrain data audit RUN_DIR`, in-process (the CLI's own main)."""
    capsys.readouterr()
    code = main(["data", "audit", str(run_dir)])
    return code, capsys.readouterr().out.splitlines()


@pytest.mark.parametrize(("dataset", "cut"), [(mixture, 3), (sft, 5)], ids=["mixture", "sft"])
def test_every_run_sees_the_same_global_batches(data_root, tmp_path, capsys, dataset, cut):
    overrides = dataset(data_root)
    uninterrupted = tmp_path / "a"
    train(uninterrupted, *overrides, nproc=2)
    reference = read_audit(uninterrupted / "samples.jsonl")
    assert sorted(reference) == list(range(1, STEPS + 1))

    interrupted = tmp_path / "b"
    train(interrupted, *overrides, f"train.stop_after_steps={cut}", nproc=2)
    train(interrupted, *overrides, nproc=2)
    assert read_audit(interrupted / "samples.jsonl") == reference, f"interrupted after step {cut}"

    elastic = tmp_path / "c"
    train(elastic, *overrides, "train.stop_after_steps=3", nproc=2)
    train(elastic, *overrides, "train.stop_after_steps=2")  # one rank
    train(elastic, *overrides, nproc=4)
    assert read_audit(elastic / "samples.jsonl") == reference

    if dataset is mixture:  # the realized mixture is logged, and follows the 3:1 weights
        from clustertrain.train.metrics import read_metrics

        last = [r for r in read_metrics(uninterrupted / "metrics.jsonl") if "mix/code" in r][-1]
        assert last["mix/code"] + last["mix/prose"] == pytest.approx(1.0)
        assert last["mix/code"] == pytest.approx(0.75, abs=0.15)

    for run_dir in (uninterrupted, interrupted, elastic):
        code, lines = audit(run_dir, capsys)
        assert code == 0 and "repeated 0, skipped 0, unexpected 0" in lines, lines


@pytest.fixture(scope="module")
def audited(data_root, tmp_path_factory):
    """An honest 1-rank run of the mixture with data.audit: 4 steps of 8 samples."""
    run_dir = tmp_path_factory.mktemp("audited")
    train(run_dir, *mixture(data_root), "train.steps=4")
    return run_dir


def planted(audited, tmp_path, plant) -> tuple:
    """A copy of the audited run whose samples.jsonl went through `plant(steps)`; returns (run_dir, steps)."""
    shutil.copy(audited / "config.yaml", tmp_path / "config.yaml")
    steps = {step: [list(s) for s in samples] for step, samples in read_audit(audited / "samples.jsonl").items()}
    plant(steps)
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps({"step": k, "samples": v}) + "\n"
                                                    for k, v in sorted(steps.items())))
    return tmp_path, steps


def named(sample) -> str:
    source, document, offset, epoch = sample
    return f"{source} document {document} at token {offset} (epoch {epoch})"


def test_the_audit_passes_an_honest_run_and_a_step_written_twice(audited, tmp_path, capsys):
    code, lines = audit(audited, capsys)
    assert code == 0, lines
    assert lines[:2] == ["steps 4, samples 32, missing steps 0", "repeated 0, skipped 0, unexpected 0"], lines
    assert len(lines) == 3  # and the proportions: no problem lines
    # a killed run re-does the steps after its last checkpoint: the same step written again counts once
    again = (audited / "samples.jsonl").read_text().splitlines(keepends=True)[2]
    shutil.copytree(audited, tmp_path / "redone")
    with (tmp_path / "redone" / "samples.jsonl").open("a") as f:
        f.write(again)
    assert audit(tmp_path / "redone", capsys)[0] == 0


def test_the_audit_names_a_repeated_sample(audited, tmp_path, capsys):
    run_dir, steps = planted(audited, tmp_path, lambda steps: steps[3].append(steps[1][0]))  # served twice
    code, lines = audit(run_dir, capsys)
    assert code == 1
    assert "repeated 1, skipped 0, unexpected 1" in lines, lines
    assert f"repeated: {named(steps[1][0])}, recorded at steps 1, 3" in lines, lines
    assert f"unexpected: {named(steps[1][0])}, recorded at steps 1, 3" in lines, lines


def test_the_audit_names_a_skipped_sample(audited, tmp_path, capsys):
    run_dir, _ = planted(audited, tmp_path, lambda steps: steps[3].pop())  # never served
    skipped = read_audit(audited / "samples.jsonl")[3][-1]
    code, lines = audit(run_dir, capsys)
    assert code == 1
    assert "repeated 0, skipped 1, unexpected 0" in lines, lines
    assert f"skipped: {named(skipped)}, due at step 3" in lines, lines


def test_the_audit_names_both_sides_of_a_stale_sample_and_a_missing_step(audited, tmp_path, capsys):
    def plant(steps):  # a resume that serves an old sample in place of the next one, and a step never recorded
        steps[4][-1] = steps[2][0]
        del steps[3]

    run_dir, steps = planted(audited, tmp_path, plant)
    replaced = read_audit(audited / "samples.jsonl")[4][-1]
    code, lines = audit(run_dir, capsys)
    assert code == 1
    assert lines[0] == "steps 3, samples 24, missing steps 1" and "missing steps: 3" in lines, lines
    assert f"repeated: {named(steps[2][0])}, recorded at steps 2, 4" in lines, lines
    assert f"skipped: {named(replaced)}, due at step 4" in lines, lines
