"""`clustertrain verify`: a layout against the 1-rank reference, with real ranks, and its user errors."""

from __future__ import annotations

import re

import pytest
from helpers import TINY, run_cli
from pydantic import BaseModel

from clustertrain.cli import main, verify_cmd
from clustertrain.config.load import load_config

STEPS = 3


def verify(*args: str) -> tuple[int, list[str], str]:
    """(exit code, stdout lines, stderr) of `clustertrain verify ARGS` on the tiny model (ARGS' --set win)."""
    result = run_cli("verify", "--steps", str(STEPS), *(f"--set={o}" for o in TINY), *args)
    return result.returncode, result.stdout.splitlines(), result.stderr


def verify_here(capsys, *args: str) -> tuple[int, list[str], str]:
    """verify() in-process, through the CLI's own main(), for refusals that come before any run starts."""
    capsys.readouterr()
    code = main(["verify", "--steps", str(STEPS), *(f"--set={o}" for o in TINY), *args])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def largest_difference(last_line: str) -> float:
    return float(re.match(r"largest relative difference: (\S+) ", last_line)[1])


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    """A zero3 config whose own run directory must stay untouched, verified on 2 ranks."""
    root = tmp_path_factory.mktemp("verify-zero3")
    (root / "zero3.yaml").write_text(f"parallel:\n  strategy: zero3\ntrain:\n  run_dir: {root / 'real-run'}\n")
    code, lines, stderr = verify(str(root / "zero3.yaml"), "--nproc", "2", "--out", str(root / "out"))
    return root, code, lines, stderr


@pytest.mark.dist
def test_zero3_on_two_ranks_matches_one_rank(zero3):
    _, code, lines, stderr = zero3
    assert code == 0, "\n".join(lines) + stderr[-3000:]
    assert lines[-1].endswith("tolerance 1e-04 for float32: PASS"), lines[-1]
    assert largest_difference(lines[-1]) < 1e-4
    assert any(line.startswith("layout: 2 ranks, zero3, float32, 3 steps") for line in lines)
    assert any(line.startswith("reference: 1 rank, ddp, float32, 3 steps") for line in lines)
    table = [line.split() for line in lines if re.match(r"\s+\d+\s", line)]
    assert [int(row[0]) for row in table] == list(range(1, STEPS + 1))
    assert all(row[1] == row[2] for row in table)  # the loss itself agrees to the printed 8 digits here


@pytest.mark.dist
def test_runs_are_kept_in_out_and_not_in_the_real_run_dir(zero3):
    root, code, lines, _ = zero3
    assert code == 0
    assert f"runs kept in {root / 'out'} (layout/, reference/ and their .log files)" in lines
    assert not (root / "real-run").exists()
    for name in ("layout", "reference"):
        assert (root / "out" / name / "metrics.jsonl").is_file()
        assert (root / "out" / f"{name}.log").is_file()
        assert not (root / "out" / name / "checkpoints").exists()
    reference = load_config(root / "out" / "reference" / "config.yaml")
    assert reference.parallel.strategy == "ddp" and reference.train.steps == STEPS


@pytest.mark.dist
def test_a_reference_that_computes_something_else_fails(tmp_path):
    code, lines, stderr = verify("--nproc", "1", "--set", "optim.lr=1e-2", "--reference-set", "optim.lr=1e-3",
                                 "--out", str(tmp_path))
    assert code == 1, "\n".join(lines) + stderr[-3000:]
    assert lines[-1].endswith(": FAIL"), lines[-1] + stderr[-3000:]
    assert largest_difference(lines[-1]) > 1e-4


def test_bad_key_fails_in_one_line_before_training(tmp_path, capsys):
    code, lines, stderr = verify_here(capsys, "--set", "parallel.nope=1", "--out", str(tmp_path / "out"))
    assert code == 2
    assert stderr == "error: config error: unknown key 'parallel.nope'\n"
    assert lines == [] and not (tmp_path / "out").exists()


def test_missing_config_file_is_one_line(tmp_path, capsys):
    code, _, stderr = verify_here(capsys, str(tmp_path / "missing.yaml"))
    assert code == 2
    assert stderr == f"error: config file not found: {tmp_path / 'missing.yaml'}\n"


@pytest.mark.dist
def test_a_user_error_inside_a_run_is_one_line(tmp_path):
    code, _, stderr = verify("--nproc", "1", "--set", "data.sources=[{format: text, path: /nonexistent/*.txt}]",
                             "--out", str(tmp_path))
    assert code == 2
    assert stderr == "error: layout run: data source '/nonexistent/*.txt': no such file, directory or matching files\n"


def test_out_holding_something_else_is_left_alone(tmp_path, capsys):
    (tmp_path / "layout").mkdir()
    (tmp_path / "layout" / "notes.txt").write_text("mine")
    code, _, stderr = verify_here(capsys, "--out", str(tmp_path))
    assert code == 2
    assert stderr == (f"error: {tmp_path / 'layout'} exists and is not a verify run; give --out a new or empty "
                      "directory\n")
    assert (tmp_path / "layout" / "notes.txt").read_text() == "mine"


def test_reference_resets_the_layout_keys_the_schema_has(monkeypatch):
    from clustertrain.config import schema

    resets = verify_cmd.reference_resets()
    assert resets[0] == "parallel.strategy=ddp"
    present = [k for k in verify_cmd.LAYOUT_KEYS if k in schema.ParallelConfig.model_fields]
    assert [r.split("=")[0] for r in resets[1:]] == [f"parallel.{k}" for k in present]
    reference = load_config(None, ["parallel.strategy=hybrid_zero3", "parallel.hybrid_shard_size=2", *resets])
    assert reference.parallel == schema.ParallelConfig()

    class Older(BaseModel):  # a schema from before tp, pp and dp_*
        strategy: str = "ddp"
        hybrid_shard_size: int | None = None

    monkeypatch.setattr(schema, "ParallelConfig", Older)
    assert verify_cmd.reference_resets() == ["parallel.strategy=ddp", "parallel.hybrid_shard_size=null"]


@pytest.mark.dist
def test_tensor_and_sequence_parallel_with_lora_on_two_ranks_matches_one_rank(tmp_path):
    """Qwen2 with LoRA at tp 2, the sequence split over the ranks (parallel.sequence_parallel auto), over 3 steps."""
    qwen2 = ("model.arch=qwen2", "model.config={hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
             "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 256}")
    sets = [f"--set={o}" for o in (*qwen2, "parallel.tp=2", "lora.rank=4", "optim.lr=1e-2", "optim.warmup_steps=0")]
    code, lines, stderr = verify("--nproc", "2", *sets, "--out", str(tmp_path))
    assert code == 0, "\n".join(lines) + stderr[-3000:]
    assert lines[-1].endswith("tolerance 1e-04 for float32: PASS"), lines[-1]
    assert largest_difference(lines[-1]) < 1e-4
