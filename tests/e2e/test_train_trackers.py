"""A real run with W&B (offline) and MLflow (its local store) and its resume: each tracker holds the config, the plan
and every metric, read back with the trackers' own formats, and the resume appends to the same tracker runs;
TensorBoard has the grouped tags and the config as text. A tracker server that never answers costs the run neither
its speed nor its stop signals."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import time

import pytest
import yaml
from helpers import check_ending, losses, start, train, wait_for_step

from clustertrain.errors import ExitCode
from clustertrain.train.metrics import read_metrics

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
    records = read_metrics(run / "metrics.jsonl")
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


@pytest.fixture
def never_answers():
    """The URI of an MLflow server that accepts connections and never replies: a listening socket that never
    accepts (the kernel completes the handshakes), where MLflow's client waits 120 s a request, retried."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


def test_an_mlflow_server_that_never_answers_is_dropped_with_one_warning_and_the_run_keeps_its_speed(
        tmp_path, never_answers):
    steps = ("train.steps=300", "train.sample_tokens=0")
    train(tmp_path / "plain", *steps)
    result = train(tmp_path / "stalled", *steps, "metrics.mlflow.enabled=true",
                   f"metrics.mlflow.tracking_uri={never_answers}", "metrics.tracker_timeout_s=2")
    assert result.stderr == ("warning: MLflow did not answer within 2s (start); the run goes on without it, "
                             "metrics.jsonl has every number\n")
    speed = {}
    for name in ("plain", "stalled"):
        records = read_metrics(tmp_path / name / "metrics.jsonl")
        assert max(losses(tmp_path / name)) == 300
        # past MLflow's import (on its thread: a second or two of CPU in the first steps, as for any MLflow run)
        speed[name] = statistics.median(r["tokens_per_s"] for r in records if r["step"] > 150 and "tokens_per_s" in r)
    assert speed["stalled"] > 0.6 * speed["plain"], speed  # the same but for the noise of a shared machine


def test_sigterm_during_a_stalled_tracker_call_saves_and_exits_75_within_30_s(tmp_path, never_answers):
    limit = 12
    proc = start(tmp_path, "train.steps=100000", "checkpoint.every=0", "metrics.mlflow.enabled=true",
                 f"metrics.mlflow.tracking_uri={never_answers}", f"metrics.tracker_timeout_s={limit}", nproc=None)
    deadline = time.monotonic() + 60
    while not (tmp_path / "run.lock").exists():  # taken before the model is built, and MLflow's start after that
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    locked = time.monotonic()
    wait_for_step(tmp_path, 2, proc, timeout=60)
    signalled = time.monotonic()
    assert signalled - locked < limit  # so MLflow's start is still waiting for its answer
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    took = time.monotonic() - signalled
    check_ending(tmp_path, subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), ExitCode.REQUEUE)
    assert took < 30, took  # the limit less the seconds from MLflow's start to step 2, and the exit: 13.5 s measured
    saved = sorted((tmp_path / "checkpoints").glob("step-*"))
    assert [int(p.name.split("-")[1]) for p in saved] == [max(losses(tmp_path))]
    assert f"stopped by SIGTERM at step {max(losses(tmp_path))}" in stderr
    assert stderr.count("MLflow") == 1 and f"MLflow did not answer within {limit}s (start)" in stderr, stderr
    assert not (tmp_path / "run.lock").exists()
    # Its resume has no MLflow run to continue (none ever opened: no trackers.json), and says so.
    result = train(tmp_path, f"train.steps={max(losses(tmp_path)) + 2}", "train.sample_tokens=0",
                   "metrics.mlflow.enabled=true", f"metrics.mlflow.tracking_uri={never_answers}",
                   "metrics.tracker_timeout_s=1")
    assert result.stderr.splitlines() == [
        f"warning: {tmp_path / 'trackers.json'} is missing; this resumed run starts a new MLflow run",
        "warning: MLflow did not answer within 1s (start); the run goes on without it, metrics.jsonl has every number"]
