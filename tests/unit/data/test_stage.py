"""`clustertrain stage dataset` from local datasets (the hub's code path: `datasets` streaming, the source local):
shards and manifest, limits, a stop at any moment resumed to the very same shards, a staged folder as a training
source, and bad input in one line."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import popen, run_cli

from clustertrain.cli import main
from clustertrain.config.data_schema import DataConfig, SourceConfig
from clustertrain.data.sources import open_source
from clustertrain.data.stage import StageRequest, stage_dataset
from clustertrain.data.staged import MANIFEST, verify_stage
from clustertrain.data.tokenize import train_bpe
from clustertrain.errors import DataError

WORDS = ["alpha", "beta", "gamma", "delta", "ünïcode", "x = 1", "def f():", "\n", "42"]


def write_jsonl_dataset(folder: Path, files: int = 3, rows: int = 40, seed: int = 0) -> list[str]:
    """A folder of jsonl files with `text` and `meta` fields; the texts in file order."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    texts = []
    for f in range(files):
        with (folder / f"part-{f}.jsonl").open("w") as out:
            for i in range(rows):
                text = f"{f}/{i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
                out.write(json.dumps({"text": text, "meta": {"i": i}}) + "\n")
                texts.append(text)
    return texts


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, list[str]]:
    folder = tmp_path_factory.mktemp("hub") / "web"
    return folder, write_jsonl_dataset(folder)


def shard_texts(out: Path) -> list[str]:
    manifest = json.loads((out / MANIFEST).read_text())
    return [t for shard in manifest["shards"] for t in pq.read_table(out / shard["file"])["text"].to_pylist()]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_stage_holds_the_first_rows_in_order_with_checksums_and_reads_as_a_source(dataset, tmp_path):
    folder, texts = dataset
    out = tmp_path / "staged"
    manifest = stage_dataset(StageRequest(source=str(folder), out=out, max_rows=50, shard_rows=16))
    assert [s["rows"] for s in manifest["shards"]] == [16, 16, 16, 2]
    assert shard_texts(out) == texts[:50]  # the source's order, across its files, nothing shuffled
    for shard in manifest["shards"]:
        assert shard["sha256"] == sha256(out / shard["file"]) and shard["bytes"] == (out / shard["file"]).stat().st_size
        assert shard["tokens"] is None  # no tokenizer: rows and bytes only
    assert (manifest["complete"], manifest["ended_by"], manifest["source"], manifest["split"]) == (
        True, "max_rows", str(folder), "train")
    assert len(manifest["fingerprint"]) == 64 and manifest["revision"] is None
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST] + [f"part-0000{i}.parquet" for i in range(4)]

    source = open_source(SourceConfig(path=str(out)), cache_dir=tmp_path / "cache")  # `path: OUT` just works
    assert source.format == "parquet" and [d.record["text"] for d in source.read(0, len(source))] == texts[:50]
    assert verify_stage(out) == [] and main(["stage", "dataset", "--verify", str(out)]) == 0

    shard = out / "part-00001.parquet"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1  # a flipped bit, the size unchanged: training's open does not see it, --verify does
    shard.write_bytes(bytes(data))
    assert [line.split(":")[0] for line in verify_stage(out)] == [str(shard)]
    assert main(["stage", "dataset", "--verify", str(out)]) == 1
    shard.write_bytes(bytes(data[:-1]))
    with pytest.raises(DataError, match=f"{shard}: {len(data) - 1} bytes, not the manifest's {len(data)}; stage"):
        open_source(SourceConfig(path=str(out)), cache_dir=tmp_path / "cache")


def test_the_whole_source_and_other_kinds_of_local_dataset(dataset, tmp_path):
    folder, texts = dataset
    whole = stage_dataset(StageRequest(source=str(folder), out=tmp_path / "whole", shard_rows=50))
    assert (whole["ended_by"], [s["rows"] for s in whole["shards"]]) == ("end of source", [50, 50, 20])
    parquet = tmp_path / "one.parquet"
    pq.write_table(pa.table({"body": texts[:30], "n": list(range(30))}), parquet)
    one = stage_dataset(StageRequest(source=str(parquet), out=tmp_path / "file", text_field="body", max_rows=25))
    assert shard_texts(tmp_path / "file") == texts[:25] and one["ended_by"] == "max_rows"
    import datasets

    saved = tmp_path / "saved"
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": texts[:12]})}).save_to_disk(str(saved))
    stage_dataset(StageRequest(source=str(saved), out=tmp_path / "disk", split="validation", shard_rows=5))
    assert shard_texts(tmp_path / "disk") == texts[:12]


def test_max_tokens_counts_what_training_sees_with_the_runs_tokenizer(dataset, tmp_path):
    folder, texts = dataset
    tokenizer_dir = tmp_path / "tok"
    train_bpe(DataConfig(sources=[SourceConfig(path=str(folder))], vocab_size=300), tokenizer_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    counts = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts]  # + the EOS packing adds
    limit = sum(counts[:37]) - 3  # reached inside row 37: that row is the last one staged
    manifest = stage_dataset(StageRequest(source=str(folder), out=tmp_path / "out", max_tokens=limit,
                                          tokenizer=str(tokenizer_dir), shard_rows=10))
    assert shard_texts(tmp_path / "out") == texts[:37] and manifest["ended_by"] == "max_tokens"
    assert [s["tokens"] for s in manifest["shards"]] == [sum(counts[i:min(i + 10, 37)]) for i in range(0, 37, 10)]
    whole = stage_dataset(StageRequest(source=str(folder), out=tmp_path / "all", max_tokens=sum(counts) + 1,
                                       tokenizer=str(tokenizer_dir), shard_rows=10))  # the source ends first
    assert (whole["ended_by"], [s["tokens"] for s in whole["shards"]]) == (
        "end of source", [sum(counts[i:i + 10]) for i in range(0, 120, 10)])


def request(folder: Path, out: Path) -> StageRequest:
    return StageRequest(source=str(folder), out=out, max_rows=100, shard_rows=12)


class StopAfter(Exception):
    pass


def test_a_stage_stopped_after_any_shard_resumes_to_the_same_shards(dataset, tmp_path):
    folder, texts = dataset
    reference = stage_dataset(request(folder, tmp_path / "reference"))
    for stop_after in (1, 4):
        out = tmp_path / f"stopped-{stop_after}"

        def stop(manifest, k=stop_after):
            if len(manifest["shards"]) == k:
                raise StopAfter

        with pytest.raises(StopAfter):
            stage_dataset(request(folder, out), on_shard=stop)
        partial = json.loads((out / MANIFEST).read_text())
        assert not partial["complete"] and len(partial["shards"]) == stop_after
        with pytest.raises(DataError, match=r"is a partial stage \(\d+ shards, \d+ rows so far\): finish it"):
            open_source(SourceConfig(path=str(out)), cache_dir=tmp_path / "cache")
        # a kill between a shard's rename and the manifest's write, and one mid-write, leave files it never listed
        (out / f"part-{stop_after:05d}.parquet").write_bytes(b"unlisted")
        (out / f".part-{stop_after + 1:05d}.parquet.tmp").write_bytes(b"half")
        resumed = stage_dataset(request(folder, out))
        assert resumed["shards"] == reference["shards"], f"stopped after {stop_after} shards"
        assert shard_texts(out) == texts[:100]
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (tmp_path / "reference").iterdir())


def test_a_stage_killed_mid_way_resumes_to_the_same_shards(tmp_path, capsys):
    folder = tmp_path / "big"
    texts = write_jsonl_dataset(folder, files=3, rows=1000, seed=1)
    out, reference = tmp_path / "killed", tmp_path / "reference"
    args = ["stage", "dataset", str(folder), str(out), "--shard-rows", "30"]
    proc = popen(["-m", "clustertrain", *args])
    manifest = out / MANIFEST
    deadline = time.monotonic() + 120
    while not (manifest.is_file() and len(json.loads(manifest.read_text())["shards"]) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, "the stage ended before it could be killed"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    killed = json.loads(manifest.read_text())
    assert not killed["complete"] and 3 <= len(killed["shards"]) < 100
    assert main(args) == 0
    assert main(["stage", "dataset", str(folder), str(reference), "--shard-rows", "30"]) == 0
    ours, theirs = (json.loads((o / MANIFEST).read_text())["shards"] for o in (out, reference))
    assert ours == theirs and len(ours) == 100
    assert shard_texts(out) == texts  # no row lost or repeated
    capsys.readouterr()
    assert main(args) == 0  # once more: complete, so nothing is read
    assert capsys.readouterr().out.startswith("already complete, nothing fetched: 3,000 rows in 100 shards in ")


def test_dry_run_says_what_it_would_fetch_and_writes_nothing(dataset, tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as on a compute node: no hub
    folder, _ = dataset
    out = tmp_path / "out"
    assert main(["stage", "dataset", str(folder), str(out), "--max-rows", "1.5K", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"source: local dataset {folder} (3 files, fingerprint ")
    assert "limit: the first 1,500 rows" in lines and lines[-1] == "dry run: nothing fetched or written"
    assert not out.exists()
    hub_id = "HuggingFaceTB/finemath"
    assert main(["stage", "dataset", hub_id, str(out), "--subset", "finemath-4plus", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["source: hub dataset HuggingFaceTB/finemath at revision unknown (the hub cannot be reached)",
                         "subset: finemath-4plus, split: train, text field: text"]
    assert not out.exists()


def bad_inputs(folder: Path, tmp_path: Path) -> list[tuple[list[str], str]]:
    other = tmp_path / "other"
    write_jsonl_dataset(other, files=1, rows=5)
    taken = tmp_path / "taken"
    stage_dataset(StageRequest(source=str(other), out=taken))
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    broken = tmp_path / "broken"  # Arrow's JSON reader said "cannot read row 0 (... Invalid encoding ...)"
    write_jsonl_dataset(broken, files=2, rows=150)
    lines = (broken / "part-1.jsonl").read_text().splitlines(keepends=True)
    lines[100] = '{"text": "an unterminated string\n'
    (broken / "part-1.jsonl").write_text("".join(lines))
    return [
        ([str(tmp_path / "missing"), str(tmp_path / "o1")], f"{tmp_path / 'missing'}: no such file or directory"),
        ([str(folder), str(tmp_path / "o2"), "--text-field", "content"],
         f"{folder}: its records have no field 'content' (fields: text, meta); give --text-field"),
        ([str(folder), str(tmp_path / "o3"), "--max-rows", "5", "--max-tokens", "5"],
         "give --max-tokens or --max-rows, not both"),
        ([str(folder), str(tmp_path / "o4"), "--max-tokens", "5"], "--max-tokens counts the run's tokens: give "),
        ([str(folder), str(tmp_path / "o5"), "--max-rows", "many"], "--max-rows 'many' is not a count"),
        ([str(folder), str(tmp_path / "o6"), "--split", "test"], f"{folder}: "),
        ([str(folder), str(tmp_path / "o8"), "--tokenizer", str(tmp_path / "none")],
         f"--tokenizer: {tmp_path / 'none'} is not a tokenizer directory"),
        ([str(folder), str(taken)],
         f"{taken} holds a stage of {other} with source {str(other)!r}, not {str(folder)!r}"),
        ([str(folder), str(full)], f"{full}: not empty and holds no {MANIFEST}"),
        ([str(broken), str(tmp_path / "o9")],
         f"{broken / 'part-1.jsonl'}:101: malformed JSON (Invalid control character at column 33)\n"),
    ]


def test_bad_input_is_one_line_and_exit_2(dataset, tmp_path, capsys):
    folder, _ = dataset
    for args, message in bad_inputs(folder, tmp_path):
        capsys.readouterr()
        assert main(["stage", "dataset", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and err.count("\n") == 1, (args, err)
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 10))  # a refused stage writes nothing
    result = run_cli("stage", "dataset", str(folder), str(tmp_path / "o7"), "--max-rows", "1", "--max-tokens", "1")
    assert (result.returncode, result.stderr) == (2, "error: give --max-tokens or --max-rows, not both\n")


def test_the_mixture_recipe_stages_each_part_at_its_weight():
    """configs/frontier-pretrain-mixture.yaml: its stage commands parse, and each stages its source's weight of the
    run's tokens (plus the same headroom), into the folder the source reads."""
    from clustertrain.cli import build_parser
    from clustertrain.cli.stage_cmd import count
    from clustertrain.resolve.load import load_checked_config

    recipe = Path(__file__).parents[3] / "configs" / "frontier-pretrain-mixture.yaml"
    config = load_checked_config(recipe)
    lines = [line.removeprefix("#   ") for line in recipe.read_text().splitlines()
             if line.startswith("#   clustertrain stage dataset")]
    assert len(lines) == 3
    folder = {"D": "/lustre/orion/abc123/scratch/me/data", "T": config.data.tokenizer}
    staged = {}
    for line in lines:
        args = build_parser().parse_args([word.replace("$D", folder["D"]).replace("$T", folder["T"])
                                          for word in line.split()[1:]])
        assert args.tokenizer == config.data.tokenizer
        staged[args.out] = count("--max-tokens", args.max_tokens)
    weights = {s.path: s.weight / sum(t.weight for t in config.data.sources) for s in config.data.sources}
    assert staged.keys() == weights.keys()
    for path, tokens in staged.items():
        assert tokens == pytest.approx(1.1 * weights[path] * config.train.tokens), path


DISK_SCRIPT = """
import contextlib, io, json, subprocess, sys
from pathlib import Path
from clustertrain.cli import main

source, mnt = sys.argv[1], Path(sys.argv[2])
out = mnt / "out"


def stage():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["stage", "dataset", source, str(out), "--shard-rows", "100"])
    files = {p.name: p.read_bytes().hex() if p.name != "manifest.json" else p.read_text() for p in out.iterdir()}
    return {"code": code, "err": err.getvalue(), "files": files}


subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], check=True)
full = stage()
subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
read_only = stage()
subprocess.run(["mount", "-o", "remount,rw,size=8m", str(mnt)], check=True)
resumed = stage()
print(json.dumps({"full": full, "read_only": read_only, "resumed": resumed}))
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_a_full_or_read_only_disk_is_one_line_and_the_same_command_resumes(tmp_path):
    """A real 256 KiB tmpfs, in a user and mount namespace of its own (root ignores a folder's mode; skipped where
    unprivileged namespaces are not allowed, as in tests/unit/train/test_status.py): filled mid-stage (exit 74),
    then read-only (exit 2), each in one line that names the path and the OS's reason, the listed shards and the
    manifest untouched; with room again the same command resumes to the shards of a stage never stopped."""
    folder = tmp_path / "source"
    folder.mkdir()
    rng = random.Random(0)  # hex of random bytes: shards that Parquet cannot compress below the tmpfs
    with (folder / "rows.jsonl").open("w") as f:
        for _ in range(3000):
            f.write(json.dumps({"text": rng.randbytes(100).hex()}) + "\n")
    (tmp_path / "mnt").mkdir()
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs tmpfs {tmp_path / 'mnt'}"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no unprivileged tmpfs mount here: {probe.stderr.decode().strip()[:200]}")
    result = subprocess.run(["unshare", "-rm", sys.executable, "-c", DISK_SCRIPT, str(folder), str(tmp_path / "mnt")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    full, read_only, resumed = json.loads(result.stdout.splitlines()[-1]).values()
    out = tmp_path / "mnt" / "out"

    assert full["code"] == 74 and full["err"].count("\n") == 1, full["err"]
    assert full["err"].startswith(f"error: writing {out} failed: no space left on device; the shards "
                                  f"{out / MANIFEST} lists are intact: free space and run the same command again")
    manifest = json.loads(full["files"][MANIFEST])
    assert not manifest["complete"] and 3 <= len(manifest["shards"]) < 30
    assert sorted(full["files"]) == sorted([MANIFEST, *(s["file"] for s in manifest["shards"])])  # no partial shard
    for shard in manifest["shards"]:
        assert hashlib.sha256(bytes.fromhex(full["files"][shard["file"]])).hexdigest() == shard["sha256"]

    assert read_only["code"] == 2 and read_only["err"].count("\n") == 1, read_only["err"]
    assert read_only["err"].startswith(f"error: cannot write {out}: read-only file system; stage into a folder you "
                                       "can write to")
    assert read_only["files"] == full["files"]  # nothing lost, nothing half-written

    reference = stage_dataset(StageRequest(source=str(folder), out=tmp_path / "reference", shard_rows=100))
    assert resumed["code"] == 0, resumed["err"]
    assert json.loads(resumed["files"][MANIFEST])["shards"] == reference["shards"] and len(reference["shards"]) == 30
