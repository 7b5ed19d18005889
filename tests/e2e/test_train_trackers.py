"""A real run with W&B (offline) and MLflow (its local store) and its resume: each tracker holds the config, the plan
and every metric, read back with the trackers' own formats, and the resume appends to the same tracker runs;
TensorBoard has the grouped tags and the config as text."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import yaml
from helpers import train

from clustertrain.train.metrics import read_jsonl

pytestmark = pytest.mark.dist  # trains


def wandb_records(path):
    """The protobuf records of an offline run's .wandb file: a W&B header of 7 bytes, then LevelDB's log format
    (32 KiB blocks of chunks, each with a 7-byte header: CRC, length, type full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunks = 7, b""
    while pos + 7 <= len(data):
        if (left := 32768 - pos % 32768) < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zeros: the end of what was written
            break
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, or the last of several
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def wandb_history(folder) -> tuple[list[dict], dict]:
    """Every logged row and the config of the offline run in `folder`."""
    rows, config = [], {}
    for record in wandb_records(next(folder.glob("run-*.wandb"))):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
        elif record.WhichOneof("record_type") == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    return rows, config


def test_wandb_offline_and_mlflow_hold_the_config_plan_and_every_metric_and_a_resume_continues_them(tmp_path):
    run = tmp_path / "run"
    trackers = ("metrics.wandb.enabled=true", "metrics.mlflow.enabled=true", "metrics.plan=true")
    result = train(run, *trackers, "train.steps=4", "checkpoint.every=2", "train.eval_every=2", "train.eval_batches=1")
    ids = json.loads((run / "trackers.json").read_text())
    assert f"W&B: offline run {ids['wandb']} in {run / 'wandb'}" in result.stdout
    # A restart that does steps 3-4 again, as after a kill before step 4's save: resumed from step 2.
    shutil.rmtree(run / "checkpoints" / "step-0000004")
    train(run, *trackers, "train.steps=4", "checkpoint.every=2", "train.eval_every=2", "train.eval_batches=1")
    assert json.loads((run / "trackers.json").read_text()) == ids  # the same tracker runs
    records = read_jsonl(run / "metrics.jsonl")
    logged = [(r["step"], r["loss"]) for r in records if "loss" in r]
    assert [step for step, _ in logged] == [1, 2, 3, 4, 3, 4]

    # W&B: one offline folder per start, both of the one run id; every metric, grouped, at our step.
    folders = sorted((run / "wandb").glob("offline-run-*"))
    assert [f.name.rsplit("-", 1)[1] for f in folders] == [ids["wandb"]] * 2
    rows, config = [], {}
    for folder in folders:
        more, config = wandb_history(folder)
        rows += more
        assert config["optim"]["lr"] == yaml.safe_load((run / "config.yaml").read_text())["optim"]["lr"]
        assert config["plan"]["tokens_per_step"] == 512 and config["plan"]["peak_bytes"] > 0
    assert [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r] == pytest.approx(logged)
    assert [r["step"] for r in rows if "eval/loss" in r] == [2, 4, 4]  # step 2's eval was not done again
    assert all(r["perf/tokens_per_s"] > 0 and r["perf/mem_gb"] > 0 and r["train/lr"] > 0
               for r in rows if "train/loss" in r)

    # MLflow: one run with the config and plan as params and artifacts, every metric at its step and time.
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run / "mlruns").as_uri())
    found = client.get_run(ids["mlflow"])
    assert found.info.status == "FINISHED" and found.info.run_name == "default"
    assert found.data.params["optim.lr"] == str(config["optim"]["lr"])
    assert found.data.params["train.steps"] == "4" and int(found.data.params["plan.tokens_per_step"]) == 512
    history = client.get_metric_history(ids["mlflow"], "train/loss")
    assert [(m.step, m.value) for m in history] == pytest.approx(logged)
    times = [r["time"] for r in records if "loss" in r]
    assert [m.timestamp for m in history] == [round(t * 1000) for t in times]
    assert [m.step for m in client.get_metric_history(ids["mlflow"], "eval/loss")] == [2, 4, 4]
    artifacts = {a.path for a in client.list_artifacts(ids["mlflow"])}
    assert artifacts == {"config.yaml", "plan.json"}
    assert [e.name for e in client.search_experiments()].count("clustertrain") == 1  # made once, and one run in it
    assert len(client.search_runs([found.info.experiment_id])) == 1

    # TensorBoard: grouped tags, and the config as text.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    assert {"train/loss", "train/lr", "eval/loss", "perf/tokens_per_s", "perf/mfu", "perf/mem_gb"} <= set(
        acc.Tags()["scalars"])
    assert all(tag.split("/")[0] in ("train", "eval", "perf", "data") for tag in acc.Tags()["scalars"])
    text = acc.Tensors("config/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert yaml.safe_load("\n".join(line[4:] for line in text.splitlines())) == yaml.safe_load(
        (run / "config.yaml").read_text())
