"""`clustertrain config convert` on each document's own files (shared/seeds): the training stub's YAML as its
documentation prints it, a TOML in the Frontier torchtitan fork's (older torchtitan) layout, and the LoRA SFT
walkthrough's TRL arguments with their DeepSpeed JSON. Each is converted, `config check`ed at the document's node
counts, and trained a few steps on CPU (tiny shapes) with its values carried into the run's resolved config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import check_ending, losses, run_cli, write_tiny_repo

from clustertrain.cli import main

FIXTURES = Path(__file__).parents[2] / "fixtures" / "convert"
TINY_MODEL = ("model.config={hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
              "num_key_value_heads: 2, max_position_embeddings: 256}")
# a few steps, fast: what no document sets, or the shapes of a model too big for a test
QUICK = ["data.seq_len=64", "data.vocab_size=512", "data.num_workers=0", "train.stop_after_steps=3",
         "train.eval_every=0", "train.sample_tokens=0", "metrics.plan=false", "metrics.log_every=1"]


def convert_to(tmp_path: Path, capsys, *files: str) -> tuple[Path, dict, list[str]]:
    """`config convert FILES -o tmp_path/converted.yaml`: the file, its config and the lines on stderr before
    the last ("wrote ...")."""
    out = tmp_path / "converted.yaml"
    assert main(["config", "convert", *(str(FIXTURES / f) for f in files), "-o", str(out)]) == 0
    return out, yaml.safe_load(out.read_text()), capsys.readouterr().err.splitlines()[:-1]


def check(capsys, config: Path, *argv: str) -> str:
    assert main(["config", "check", str(config), *argv]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def trained(config: Path, run_dir: Path, *overrides: str, env: dict | None = None) -> dict:
    """Train `config` a few steps in its own folder; the config the run resolved (run_dir/config.yaml)."""
    result = run_cli("train", str(config), *[f"--set={o}" for o in (*QUICK, *overrides)], cwd=config.parent, env=env)
    check_ending(run_dir, result, state="stopped")
    assert sorted(losses(run_dir)) == [1, 2, 3]
    return yaml.safe_load((run_dir / "config.yaml").read_text())


def write_csv(path: Path, rows: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    words = "the stub reads a csv of documents one row each with its text".split()
    path.write_text("text\n" + "".join(f"{' '.join(words[i % 7:] + words[:i % 5])}\n" for i in range(rows)))


def test_the_training_stub_s_yaml_as_documented(tmp_path, capsys):
    out, config, err = convert_to(tmp_path, capsys, "stub_test_config_training.yaml")
    assert config == {
        "name": "dummy-0.1",
        "model": {"config": {"hidden_size": 1280, "num_hidden_layers": 32, "num_attention_heads": 16}},
        "data": {"sources": [{"path": "experiments/datasets/safetensor_dataset.train.csv"}], "num_workers": 1,
                 "eval_sources": [{"path": "experiments/datasets/safetensor_dataset.validate.csv"}]},
        "parallel": {"strategy": "zero3", "param_dtype": "bfloat16"},
        "optim": {"lr": 3e-4, "weight_decay": 0.05, "warmup_steps": 10},
        "train": {"run_dir": "experiments/chkpts/dummy-0.1", "steps": 1_000_000, "micro_batch_size": 256,
                  "grad_accum": 1},
        "checkpoint": {"every": 100}}
    assert err == ['not mapped: checkpoint.state_dict_type = "full": clustertrain saves sharded checkpoints (each '
                   "rank its shard, resumable on any rank count); `clustertrain export` writes the full weights"]
    # its documented launches: 1 node x 10 GPUs (S3DF/ada), 2 nodes x 8 (Frontier)
    assert "micro batch 256 × grad accum 1 × 10 dp ranks = global batch 2560" in check(capsys, out, "--world", "10")
    assert "1,000,000 steps" in check(capsys, out, "--world", "16")

    write_csv(tmp_path / "experiments/datasets/safetensor_dataset.train.csv", 400)
    write_csv(tmp_path / "experiments/datasets/safetensor_dataset.validate.csv", 40)
    run = trained(out, tmp_path / "experiments/chkpts/dummy-0.1", TINY_MODEL, "train.micro_batch_size=4")
    assert (run["optim"]["lr"], run["optim"]["weight_decay"], run["optim"]["warmup_steps"]) == (3e-4, 0.05, 10)
    assert (run["train"]["steps"], run["checkpoint"]["every"], run["name"]) == (1_000_000, 100, "dummy-0.1")
    assert (run["parallel"]["strategy"], run["parallel"]["param_dtype"]) == ("zero3", "bfloat16")
    assert run["data"]["eval_sources"][0]["path"] == "experiments/datasets/safetensor_dataset.validate.csv"


def test_a_toml_of_the_frontier_torchtitan_fork(tmp_path, capsys):
    out, config, err = convert_to(tmp_path, capsys, "torchtitan_frontier_llama3_8b_n64.toml")
    assert config["optim"] == {"lr": 3e-5, "grad_clip": 1.0, "warmup_steps": 500}
    assert config["train"] == {"run_dir": "./outputs", "steps": 500_000, "micro_batch_size": 21, "grad_accum": 1}
    assert config["parallel"] == {"strategy": "hybrid_zero3", "hybrid_shard_size": 32, "tp": 8, "pp": 1,
                                  "activation_checkpoint": "full", "compile": True}
    assert config["checkpoint"] == {"every": 100, "async": True} and config["data"] == {"seq_len": 8192}
    assert config["model"]["config"]["hidden_size"] == 4096, "the 8B flavor's sizes"
    assert [line.split(" = ")[0].removeprefix("not mapped: ") for line in err] == [
        "job.description", "profiling.enable_profiling", "profiling.save_traces_folder", "profiling.profile_freq",
        "metrics.save_tb_folder", "model.tokenizer_path", "training.dataset", "checkpoint.folder",
        "checkpoint.export_dtype"]
    # its README's run: 64 nodes x 8 GCDs, 11M tokens a step
    line = check(capsys, out, "--world", "512")
    assert "(dp_replicate 2 × dp_shard 32), tp 8" in line and "= 11,010,048 tokens/step" in line

    # one CPU rank: shard groups of 1, no tp, no compile
    run = trained(out, tmp_path / "outputs", TINY_MODEL, "train.micro_batch_size=4", "parallel.tp=1",
                  "parallel.hybrid_shard_size=1", "parallel.compile=false",
                  "data.sources=[{format: stdlib, max_bytes: 400000}]")
    assert (run["optim"]["lr"], run["optim"]["warmup_steps"], run["optim"]["grad_clip"]) == (3e-5, 500, 1.0)
    assert (run["train"]["steps"], run["checkpoint"]["every"]) == (500_000, 100)
    assert (run["parallel"]["strategy"], run["parallel"]["activation_checkpoint"]) == ("hybrid_zero3", "full")
    assert (run["checkpoint"]["async"], run["data"]["seq_len"]) == (True, 64)


def test_the_lora_walkthrough_s_trl_arguments_and_deepspeed_json(tmp_path, capsys, monkeypatch):
    scratch = tmp_path / "scratch"
    monkeypatch.setenv("SCRATCH_ROOT", str(scratch))
    out, config, err = convert_to(tmp_path, capsys, "trl_sft_llama3.yaml")  # ds_config.json by its deepspeed key
    assert config["model"] == {"path": "$SCRATCH_ROOT/llama-models-cache"}, "kept as written: expanded on the nodes"
    assert config["data"]["sources"] == [{"path": "$SCRATCH_ROOT/data_cache/mlabonne___guanaco-llama2-1k",
                                          "field": "text"}]
    assert config["lora"] == {"rank": 8, "alpha": 8, "dropout": 0.1}
    assert config["parallel"] == {"strategy": "zero2", "param_dtype": "bfloat16"}
    assert (config["optim"]["lr"], config["optim"]["weight_decay"], config["optim"]["grad_clip"],
            config["optim"]["schedule"]) == (4e-5, 0.001, 0.3, "constant")
    assert config["train"]["epochs"] == 1.0 and config["checkpoint"] == {"every": 50}
    assert err == ["not mapped: group_by_length = true: no clustertrain key for it",
                   "not mapped: ds_config.json: zero_optimization.overlap_comm = true: no clustertrain key for it",
                   "not mapped: ds_config.json: zero_optimization.contiguous_gradients = true: no clustertrain key "
                   "for it",
                   "not mapped: warmup_ratio = 0.03: a share of the steps, which epochs leave open; give "
                   "optim.warmup_steps"]
    write_tiny_repo(scratch / "llama-models-cache")  # the model and tokenizer snapshot
    arrow = scratch / "data_cache/mlabonne___guanaco-llama2-1k/data/guanaco-llama2-1k-train.arrow"
    write_arrow(arrow, [f"<s>[INST] question {i} [/INST] the answer is {i * 7} </s>" for i in range(300)])
    # its launch: 2 nodes x 8 GCDs
    assert "micro batch 1 × grad accum 1 × 16 dp ranks" in check(capsys, out, "--world", "16")

    run = trained(out, tmp_path / "results_modified", "train.micro_batch_size=4", env={"SCRATCH_ROOT": str(scratch)})
    assert run["model"]["path"] == str(scratch / "llama-models-cache")
    assert (run["lora"]["rank"], run["lora"]["alpha"], run["lora"]["dropout"]) == (8, 8.0, 0.1)
    assert (run["optim"]["lr"], run["optim"]["grad_clip"], run["checkpoint"]["every"]) == (4e-5, 0.3, 50)
    assert (run["parallel"]["strategy"], run["parallel"]["param_dtype"], run["train"]["epochs"]) == \
        ("zero2", "bfloat16", 1.0)


def write_arrow(path: Path, texts: list[str]) -> None:
    """An Arrow stream file with a text column, as `datasets` caches one."""
    import pyarrow as pa

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"text": texts})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


@pytest.mark.parametrize(("args", "warned"), [
    ("use_peft: false\nlora_r: 8\nlora_alpha: 16\n", "lora_r, lora_alpha: inert without use_peft: true"),
    ("lora_dropout: 0.1\n", "lora_dropout: inert without use_peft: true"),
    ("use_peft: true\nlora_r: 8\n", None),
    ("learning_rate: 1.0e-4\n", None),
])
def test_trl_s_lora_keys_without_use_peft_are_one_warning_line(tmp_path, capsys, args, warned):
    (tmp_path / "sft.yaml").write_text(f"model_name_or_path: gpt2\nmax_steps: 5\n{args}")
    assert main(["config", "convert", str(tmp_path / "sft.yaml")]) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("warning: ")]
    assert lines == ([] if warned is None else [lines[0]]) and (warned is None or warned in lines[0]), captured.err
    assert ("lora:" in captured.out) == ("use_peft: true" in args), "adapters only where TRL trains them"
    assert (warned is not None) == ("# warning: " in captured.out), "the converted file says so too"
