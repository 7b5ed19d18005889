"""Hostile and damaged checkpoints under real processes: no code runs from them, and every refusal is one line.

One 2-rank run (checkpoints at steps 2 and 4) is trained per module; each case tampers with a copy of it.
"""

from __future__ import annotations

import pickle
import re
import shutil

import pytest
import torch
from helpers import TINY, run_cli, train
from transformers import LlamaConfig

from clustertrain.checkpoint.export import export_hf, import_hf
from clustertrain.checkpoint.reader import read_metadata

pytestmark = pytest.mark.dist
RUN = ("train.steps=4", "checkpoint.every=2")
NEWEST, PREVIOUS = "step-0000004", "step-0000002"


class Payload:
    """Creates `marker` when unpickled by plain pickle."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trained")
    train(run_dir, *RUN, nproc=2)
    return run_dir


@pytest.fixture
def run_dir(trained, tmp_path):
    """A copy of the trained run, to tamper with."""
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def resume(run_dir, *overrides, nproc=None, resume="auto"):
    args = [f"--set={o}" for o in (*TINY, f"train.run_dir={run_dir}", *RUN, *overrides)]
    return run_cli("train", *(["--nproc", str(nproc)] if nproc else []), *args, "--resume", resume)


def load_with(command, run_dir, tmp_path):
    """Run one of the three commands that load a checkpoint: resume, export, generate."""
    if command == "resume":
        return resume(run_dir)
    if command == "export":
        return run_cli("export", str(run_dir), str(tmp_path / "exported"))
    return run_cli("generate", str(run_dir), "--prompt", "def ", "--max-tokens", "4")


def hint(command, checkpoints):
    if command == "resume":
        return f"; to go on from the previous intact checkpoint: --resume {checkpoints / PREVIOUS}"
    return f"; the previous intact checkpoint is {checkpoints / PREVIOUS}"


def files(folder):
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_refused(result, message, *, untouched=None, before=None):
    """Exit 2 with `message` as the one line on stderr; `untouched` (a folder) as it was `before`."""
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stderr[-3000:]}"
    assert result.stderr.strip() == f"error: {message}", result.stderr[-3000:]
    if untouched is not None:
        assert files(untouched) == before  # nothing written, nothing pruned


@pytest.mark.parametrize("command", ["resume", "export", "generate"])
def test_a_payload_in_metadata_never_runs(run_dir, tmp_path, command):
    marker = tmp_path / "marker"
    checkpoints = run_dir / "checkpoints"
    file = checkpoints / NEWEST / ".metadata"
    file.write_bytes(pickle.dumps(Payload(marker)))
    before = files(checkpoints)
    result = load_with(command, run_dir, tmp_path)
    assert_refused(result, f"{file} holds code or non-tensor objects (it refers to io.open) and was not loaded"
                           + hint(command, checkpoints), untouched=checkpoints, before=before)
    assert not marker.exists()
    assert not (tmp_path / "exported").exists()


@pytest.mark.parametrize("command", ["resume", "export"])  # generate loads as export does
def test_a_payload_in_a_shard_never_runs(run_dir, tmp_path, command):
    marker = tmp_path / "marker"
    checkpoints = run_dir / "checkpoints"
    newest = checkpoints / NEWEST
    info = next(s for i, s in read_metadata(newest).storage_data.items() if i.fqn.startswith("model."))
    with open(newest / info.relative_path, "r+b") as f:  # over the first bytes of a model tensor
        f.seek(info.offset)
        f.write(pickle.dumps(Payload(marker), protocol=2))  # protocol 4 is refused sooner, for its FRAME opcode
    before = files(checkpoints)
    result = load_with(command, run_dir, tmp_path)
    assert_refused(result, f"{newest / info.relative_path} holds code or non-tensor objects (it refers to io.open) "
                           "and was not loaded" + hint(command, checkpoints), untouched=checkpoints, before=before)
    assert not marker.exists()


def test_a_payload_in_a_snapshots_pytorch_model_bin_never_runs(trained, tmp_path):
    marker, snapshot = tmp_path / "marker", tmp_path / "snapshot"
    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256).save_pretrained(snapshot)
    torch.save(Payload(marker), snapshot / "pytorch_model.bin")
    tokenizer = trained / "checkpoints" / NEWEST / "tokenizer"
    overrides = (*TINY, f"train.run_dir={tmp_path / 'run'}", f"model.path={snapshot}", f"data.tokenizer={tokenizer}")
    result = run_cli("train", *[f"--set={o}" for o in overrides])
    assert_refused(result, f"{snapshot / 'pytorch_model.bin'} holds code or non-tensor objects "
                           "(it refers to io.open) and was not loaded")
    result = run_cli("generate", str(snapshot), "--prompt", "def ")  # through transformers' own loader
    assert_refused(result, f"{snapshot} holds code or non-tensor objects (it refers to io.open) and was not loaded")
    assert not marker.exists()


@pytest.mark.parametrize("layers, problem", [
    (1, "the checkpoint holds model.layers.1.self_attn.q_proj.weight (64, 64), which this run does not have"),
    (3, "the checkpoint has no model.layers.2.self_attn.q_proj.weight (64, 64), which this run has"),
])
def test_resuming_with_other_shapes_is_one_line_before_anything_is_written(run_dir, layers, problem):
    checkpoints = run_dir / "checkpoints"
    before = files(checkpoints)
    result = resume(run_dir, f"model.config.num_hidden_layers={layers}")
    assert_refused(result, f"{checkpoints / NEWEST}: {problem}; it was saved by a model of other shapes (compare "
                           "model.arch and model.config with its config.yaml)", untouched=checkpoints, before=before)


def test_an_imported_model_of_other_shapes_is_refused(trained, tmp_path):
    imported = import_hf(export_hf(trained, tmp_path / "hf"), tmp_path / "imported")
    before = files(imported)
    result = resume(tmp_path / "run", "model.config.intermediate_size=96", resume=str(imported))
    assert_refused(result, f"{imported}: model.layers.0.mlp.gate_proj.weight is (128, 64) in the checkpoint but "
                           "(96, 64) in this run's model; it was saved by a model of other shapes (compare model.arch "
                           "and model.config with its config.yaml)", untouched=imported, before=before)


def truncate(file):
    with open(file, "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)


# What is done to the newest checkpoint -> the problem named. A deleted shard and a non-integer step are checked
# in-process by tests/unit/checkpoint/test_reader.py: each process here costs seconds.
DAMAGE = {
    "truncated shard": (lambda ckpt: truncate(ckpt / "__1_0.distcp"), r"__1_0\.distcp is truncated \(\d+ bytes, \d+ "
                                                                      r"expected\)"),
    "missing metadata": (lambda ckpt: (ckpt / ".metadata").unlink(),
                         r"\.metadata is missing, so the checkpoint's shards cannot be read"),
    "corrupt rng": (lambda ckpt: (ckpt / "rng-0.json").write_text('{"python": [3, [1, 2'),
                    r"rng-0\.json is damaged \(not JSON: .*\)"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_is_one_line_with_the_previous_intact_one(run_dir, damage):
    checkpoints = run_dir / "checkpoints"
    harm, problem = DAMAGE[damage]
    harm(checkpoints / NEWEST)
    before = files(checkpoints)
    result = resume(run_dir)
    assert result.returncode == 2, result.stderr[-3000:]
    line = f"error: {re.escape(str(checkpoints / NEWEST))}/{problem}{re.escape(hint('resume', checkpoints))}"
    assert re.fullmatch(line, result.stderr.strip()), result.stderr[-3000:]  # one line: `.` stops at a newline
    assert files(checkpoints) == before


def test_a_deleted_rng_file_of_rank_1_is_named_on_rank_0(run_dir):
    checkpoints = run_dir / "checkpoints"
    (checkpoints / NEWEST / "rng-1.json").unlink()
    before = files(checkpoints)
    result = resume(run_dir, nproc=2)
    assert_refused(result, f"{checkpoints / NEWEST / 'rng-1.json'} is missing (the RNG state of a rank of the saving "
                           "run)" + hint("resume", checkpoints), untouched=checkpoints, before=before)
