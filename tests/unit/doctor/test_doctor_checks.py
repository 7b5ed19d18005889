"""The doctor's checks of one rank, in-process: each bad input is reported in one line that says what to do."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from clustertrain.config.load import load_config
from clustertrain.doctor import checks
from clustertrain.launch.presets import load_preset

FRONTIER = {"SLURM_CLUSTER_NAME": "frontier", "HF_HUB_OFFLINE": "1"}


def tiny(tmp_path: Path, *overrides: str):
    return load_config(None, ["model.config={hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
                              "num_attention_heads: 4, num_key_value_heads: 2}", "data.vocab_size=512",
                              f"train.run_dir={tmp_path / 'run'}", *overrides])


def write_snapshot(folder: Path, shards: int = 2) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    for name in names:
        (folder / name).write_bytes(b"x")
    weight_map = {f"layer.{i}": name for i, name in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def bad_data(tmp_path):
    return checks.data_sources(tiny(tmp_path, f"data.sources=[{{path: {tmp_path}/missing.jsonl}}]").data)


def bad_snapshot(tmp_path):
    folder = write_snapshot(tmp_path / "model")
    (folder / "model-00002-of-00002.safetensors").unlink()
    return [checks.snapshot(folder, hub_id="org/model")]


def bad_plugin(tmp_path):
    (tmp_path / "ofi" / "lib").mkdir(parents=True)
    (tmp_path / "ofi" / "lib" / "librccl-net.so").write_bytes(b"not a shared object")
    return [checks.rccl_plugin(str(tmp_path / "ofi"))]


def no_plugin(tmp_path):
    return [checks.rccl_plugin(str(tmp_path / "nowhere"))]


def small_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: namedtuple("usage", "total used free")(10**9, 0, 10**5))
    return checks.local_checks(tiny(tmp_path), "c.yaml", environ={"HF_HUB_OFFLINE": "1"})


def unwritable_miopen(tmp_path):
    (tmp_path / "file").write_text("")
    return [checks.miopen_cache(str(tmp_path / "file" / "miopen"))]


def hub_online(tmp_path):
    return [checks.hf_offline({"HF_HUB_OFFLINE": "0"})]


def frontier_env_missing(tmp_path):
    config = tiny(tmp_path, "slurm.preset=frontier")
    return checks.environment(config.slurm, {**FRONTIER, "NCCL_SOCKET_IFNAME": "eth0"}, "c.yaml")


CASES = {  # bad input -> (its check, what the one line must say)
    "missing data file": (bad_data, "data", "missing.jsonl"),
    "missing snapshot weight file": (bad_snapshot, "model snapshot",
                                     "model-00002-of-00002.safetensors is missing: download it again: clustertrain "
                                     "download org/model"),
    "unloadable plugin": (bad_plugin, "rccl plugin", "does not load"),
    "no plugin": (no_plugin, "rccl plugin", "build aws-ofi-rccl"),
    "too small disk": (small_disk, "disk", "lower checkpoint.keep_last"),
    "unwritable miopen cache": (unwritable_miopen, "miopen cache", "point it at node-local /tmp"),
    "hub online": (hub_online, "hf offline", "HF_HUB_OFFLINE=1"),
    "frontier variables": (frontier_env_missing, "environment", 'eval "$(clustertrain env c.yaml)"'),
}


@pytest.mark.parametrize("case", CASES)
def test_each_bad_input_is_one_line_that_says_what_to_do(case, tmp_path, monkeypatch):
    make, check, says = CASES[case]
    found = make(tmp_path, monkeypatch) if case == "too small disk" else make(tmp_path)
    failed = [f for f in found if not f.ok]
    assert [f.check for f in failed][:1] == [check], found
    assert all("\n" not in f.detail for f in failed)
    assert says in failed[0].detail, failed[0].detail


def test_frontier_names_each_missing_variable_and_what_the_preset_sets(tmp_path):
    details = [f.detail for f in frontier_env_missing(tmp_path)]
    assert any(d.startswith("NCCL_SOCKET_IFNAME is eth0; the frontier preset sets hsn0") for d in details)
    assert any(d.startswith("FI_CXI_ATS is not set; the frontier preset sets 0") for d in details)
    # ${NAME} values are checked only for presence: their expansion depends on the job
    assert any(d.startswith("MIOPEN_USER_DB_PATH is not set") for d in details)
    env = {**FRONTIER, **load_preset("frontier").env, "MIOPEN_USER_DB_PATH": "/tmp/anything"}
    assert all(f.ok for f in checks.environment(tiny(tmp_path, "slurm.preset=frontier").slurm, env, None))


def test_off_the_presets_cluster_nothing_is_compared(tmp_path):
    config = tiny(tmp_path, "slurm.preset=frontier")
    assert all(f.ok for f in checks.environment(config.slurm, {"SLURM_CLUSTER_NAME": "andes"}, None))


def test_a_good_node_passes_every_check(tmp_path):
    folder = write_snapshot(tmp_path / "model")
    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "hello"}\n')
    sources = tiny(tmp_path, f"data.sources=[{{path: {data}}}]").data
    found = [checks.snapshot(folder, None), *checks.data_sources(sources),
             *checks.local_checks(tiny(tmp_path), None, environ={"HF_HUB_OFFLINE": "1"})]
    assert all(f.ok for f in found), found


def test_checkpoint_estimate_counts_every_trained_parameter(tmp_path):
    config = tiny(tmp_path)
    size = checks.checkpoint_bytes(config)
    assert size % 12 == 0 and 12 * 100_000 < size < 12 * 200_000  # ~130k parameters, untied head included
    assert checks.kept_checkpoints(config.updated(checkpoint={"keep_last": 2})) == 3
