"""`clustertrain config convert` against hostile inputs: no byte of an input reaches the output but as a quoted
value (a key name with a line break cannot become YAML that `env` or a job script runs), `-o` never replaces an
input or an existing file unasked, and nesting, size and ZeRO-1 get one line or their documented behaviour."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from clustertrain.cli import main

FIXTURES = Path(__file__).parents[2] / "fixtures" / "convert"
# Everything YAML (or a terminal) takes for a line break, then C0/C1 controls, a bidi override and a surrogate
BREAKS = ["\n", "\r", "\r\n", "\x85", "\u2028", "\u2029", "\x0b", "\x0c", "\x1b[2K\r", "\u202e", "\ud800"]


def payloads(marker: str) -> list[str]:
    """Key names (and values) that, copied raw into a comment, end it and add sections whose lines run."""
    return [f"x{br}slurm:{br}  setup: ['touch {marker}']{br}watchdog:{br}  enabled: false{br}#" for br in BREAKS]


def toml_key(key: str) -> str:
    return json.dumps(key)  # JSON's escapes are TOML's (\n, \r, \uXXXX)


def write_inputs(kind: str, tmp, marker: str) -> list[str]:
    """The files of one converter, each key name (and a value) carrying every payload; returns their paths."""
    keys = {key: i for i, key in enumerate(payloads(marker))}
    value = payloads(marker)[0]
    if kind == "trl-json":  # the file's own name carries one too: it heads the output
        path = tmp / f"a\nslurm:\n  setup: ['touch {marker}']\n#.json"
        path.write_text(json.dumps({"learning_rate": 1e-4, "max_steps": 5, "lr_scheduler_kwargs": {"min_lr": value},
                                    **keys}))
        return [str(path)]
    if kind == "hf-yaml":
        (tmp / "args.yaml").write_text(yaml.safe_dump({"learning_rate": 1e-4, "max_steps": 5, **keys}))
        return [str(tmp / "args.yaml")]
    if kind == "deepspeed":
        (tmp / "args.json").write_text(json.dumps({"learning_rate": 1e-4, "max_steps": 5}))
        ds = tmp / f"ds\n#.json"
        ds.write_text(json.dumps({"zero_optimization": {"stage": 2, **keys}, **keys}))
        return [str(tmp / "args.json"), str(ds)]
    if kind == "torchtitan":
        lines = ["[model]", "name = 'llama3'", f"flavor = {toml_key(value)}", "[training]", "steps = 5"]
        lines += [f"{toml_key(key)} = {i}" for key, i in keys.items() if "\ud800" not in key]  # TOML has none
        (tmp / "t.toml").write_text("\n".join(lines) + "\n")
        return [str(tmp / "t.toml")]
    assert kind == "stub"
    (tmp / "stub.yaml").write_text(yaml.safe_dump({"lr_scheduler": {"total_iterations": 5}, "optim": {"lr": 1e-3},
                                                   "checkpoint": {"state_dict_type": value}, **keys}))
    return [str(tmp / "stub.yaml")]


@pytest.mark.parametrize("kind", ["trl-json", "hf-yaml", "deepspeed", "torchtitan", "stub"])
def test_no_key_name_or_value_of_any_converter_runs_through_env_or_a_job_script(kind, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "MARKER"  # `touch MARKER` runs in tmp_path
    out = tmp_path / "out.yaml"
    assert main(["config", "convert", *write_inputs(kind, tmp_path, marker.name), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    text = out.read_text()
    assert all(line.startswith("# ") for line in text.splitlines() if "touch" in line), text
    assert set(yaml.safe_load(text)) <= {"name", "model", "optim", "train", "data", "parallel", "checkpoint",
                                         "metrics"}, text
    assert all(c.isprintable() for line in (text + err).splitlines() for c in line), "a raw control character"
    assert text.count("touch") >= len(BREAKS) - 1 and err.count("touch") >= len(BREAKS) - 1, "every key named"

    shell = subprocess.run(["bash", "-c", f'env=$("{sys.executable}" -m clustertrain env out.yaml) || exit 9; '
                            'eval "$env"; printf %s "$env"'], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120, check=False)  # as the reproduction did it
    assert shell.returncode == 0, shell.stderr
    env = shell.stdout
    assert main(["slurm", "render", str(out)]) == 0
    script = capsys.readouterr().out
    assert "touch" not in env + script and "watchdog" not in script
    assert not marker.exists()


@pytest.mark.parametrize("target", ["the file", "a symlink to it", "a hard link to it", "the DeepSpeed JSON",
                                    "the DeepSpeed JSON its deepspeed key names"])
@pytest.mark.parametrize("force", [False, True])
def test_o_never_replaces_an_input(target, force, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("trl_sft_args.json", "ds_zero2.json", "ds_zero3.json"):
        (tmp_path / name).write_bytes((FIXTURES / name).read_bytes())
    inputs = ["trl_sft_args.json", "ds_zero2.json"] if target == "the DeepSpeed JSON" else ["trl_sft_args.json"]
    out = {"the file": "trl_sft_args.json", "a symlink to it": "link.yaml", "a hard link to it": "hard.yaml",
           "the DeepSpeed JSON": "./ds_zero2.json",
           "the DeepSpeed JSON its deepspeed key names": "ds_zero3.json"}[target]
    (tmp_path / "link.yaml").symlink_to(tmp_path / "trl_sft_args.json")
    os.link(tmp_path / "trl_sft_args.json", tmp_path / "hard.yaml")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert main(["config", "convert", *inputs, "-o", out, *(["--force"] * force)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "that is the input" in err[0], err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_o_replaces_an_existing_file_only_with_force(tmp_path, capsys):
    out = tmp_path / "mine.yaml"
    out.write_text("my own config\n")
    args = ["config", "convert", str(FIXTURES / "torchtitan_llama3_8b.toml"), "-o", str(out)]
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == f"error: -o {out} exists; give another file, or --force to replace it"
    assert out.read_text() == "my own config\n"
    assert main([*args, "--force"]) == 0
    assert "optim:" in out.read_text() and [p.name for p in tmp_path.iterdir()] == ["mine.yaml"]


DEEP = {"deep.json": '{"a": ' * 5000 + "1" + "}" * 5000,
        "deep-list.json": '{"learning_rate": 0.1, "a": ' + "[" * 900 + "]" * 900 + "}",
        "deep.yaml": "learning_rate: 0.1\na: " + "[" * 500 + "]" * 500,
        "dotted.toml": "[training]\n" + "x." * 50_000 + "y = 1\n",
        "dotted-table.toml": "[" + "x." * 50_000 + "y]\nz = 1\n"}


@pytest.mark.parametrize("name", list(DEEP))
def test_deep_nesting_is_one_line_at_once(name, tmp_path, capsys):
    (tmp_path / name).write_text(DEEP[name])
    start = time.monotonic()
    assert main(["config", "convert", str(tmp_path / name)]) == 2
    assert time.monotonic() - start < 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{name}: nested too deeply" in err[0], err


def test_a_100_mb_input_is_refused_at_once(tmp_path, capsys):
    with open(tmp_path / "big.json", "w") as f:
        f.write('{"learning_rate": 0.1, "run_name": "')
        f.truncate(100 * 2**20)
    start = time.monotonic()
    assert main(["config", "convert", str(tmp_path / "big.json")]) == 2
    assert time.monotonic() - start < 5
    assert capsys.readouterr().err.strip() == (f"error: config file {tmp_path / 'big.json'} is 100 MiB; a config is a "
                                               "few KB, and at most 4 MiB is read")


def test_zero_1_is_a_line_not_mapped_that_names_zero2_as_documented(tmp_path, capsys):
    (tmp_path / "ds1.json").write_text('{"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 2}')
    args = [str(FIXTURES / "trl_sft_args.json"), str(tmp_path / "ds1.json"), "-o", str(tmp_path / "c.yaml")]
    assert main(["config", "convert", *args]) == 0
    config, err = yaml.safe_load((tmp_path / "c.yaml").read_text()), capsys.readouterr().err
    assert "not mapped: ds1.json: zero_optimization.stage = 1: ZeRO-1 has no strategy here; zero2 (stage 2) is the " \
           "nearest: parallel.strategy: zero2" in err
    assert "strategy" not in config.get("parallel", {}) and config["train"]["micro_batch_size"] == 2

