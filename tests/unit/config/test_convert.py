"""`clustertrain config convert`: torchtitan, TRL/HF + DeepSpeed and training stub configs become clustertrain
configs that `config check` accepts, with their lr, steps, sequence length, batch, strategy and checkpoint
interval, and every key not mapped named. The documents' own files, trained: test_convert_documents.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from clustertrain.cli import main
from clustertrain.config.convert import convert
from clustertrain.config.load import load_config
from clustertrain.errors import ConfigError

FIXTURES = Path(__file__).parents[2] / "fixtures" / "convert"


def converted(tmp_path, capsys, *files: str) -> tuple[dict, list[str]]:
    """Run `config convert FILES -o` in tmp_path; the config written and the lines not mapped."""
    out = tmp_path / "converted.yaml"
    assert main(["config", "convert", *(str(FIXTURES / f) for f in files), "-o", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    return yaml.safe_load(out.read_text()), [line.removeprefix("not mapped: ") for line in err[:-1]]


def checked(tmp_path, capsys, world: int) -> str:
    assert main(["config", "check", str(tmp_path / "converted.yaml"), "--world", str(world)]) == 0, \
        capsys.readouterr().err
    return capsys.readouterr().out


def write_model(folder: Path, model_type: str, max_positions: int) -> None:
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
                         max_position_embeddings=max_positions).save_pretrained(folder)


def test_a_torchtitan_toml(tmp_path, capsys):
    config, unmapped = converted(tmp_path, capsys, "torchtitan_llama3_8b.toml")
    assert config["optim"] == {"lr": 3e-4, "weight_decay": 0.1, "eps": 1e-8, "grad_clip": 1.0, "warmup_steps": 200,
                               "schedule": "cosine", "min_lr_ratio": 0.1}
    assert config["train"] == {"run_dir": "./outputs/llama3_8b", "steps": 1000, "global_batch_size": 64,
                               "micro_batch_size": 2, "eval_every": 0}
    assert config["data"] == {"seq_len": 8192, "tokenizer": "./assets/hf/Llama-3.1-8B"}
    assert config["parallel"]["strategy"] == "hybrid_zero3" and config["parallel"]["hybrid_shard_size"] == 4
    assert (config["parallel"]["tp"], config["parallel"]["activation_checkpoint"]) == (2, "every_n")
    assert config["parallel"]["activation_checkpoint_every"] == 2, 'selective_ac_option = "2": every 2nd block'
    assert config["checkpoint"] == {"every": 250, "keep_last": 5, "async": False}
    assert config["model"]["config"]["num_hidden_layers"] == 32, "the 8B flavor's sizes"
    assert [line.split(" = ")[0] for line in unmapped] == [
        "job.description", "profiling.enable_profiling", "profiling.save_traces_folder", "profiling.profile_freq",
        "metrics.save_tb_folder", "lr_scheduler.decay_ratio", "training.dataset", "checkpoint.folder",
        "checkpoint.last_save_model_only", "checkpoint.export_dtype"]
    assert 'training.dataset = "c4": a torchtitan dataset name' in unmapped[6]
    line = checked(tmp_path, capsys, 16)
    assert "dp_replicate 2 × dp_shard 4), tp 2" in line and "global batch 64 sequences × 8192 tokens" in line
    assert "1,000 steps" in line


@pytest.mark.parametrize("section, expected", [
    ('mode = "selective"\nselective_ac_option = "op"', {"activation_checkpoint": "selective"}),
    ('mode = "selective"\nselective_ac_option = "3"', {"activation_checkpoint": "every_n",
                                                        "activation_checkpoint_every": 3}),
    ('mode = "selective"', {"activation_checkpoint": "every_n", "activation_checkpoint_every": 2}),  # its default
    ('mode = "full"\nselective_ac_option = "3"', {"activation_checkpoint": "full"}),
])
def test_torchtitan_s_selective_checkpointing_is_op_level_or_every_n(tmp_path, section, expected):
    """torchtitan's op-level mode is our `selective`; its every-N-th-block mode our `every_n`."""
    path = tmp_path / "t.toml"
    path.write_text(f"[activation_checkpoint]\n{section}\n")
    parallel = convert(path).config["parallel"]
    assert {k: v for k, v in parallel.items() if k.startswith("activation")} == expected


def test_trl_training_arguments_with_their_deepspeed_json(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_model(tmp_path / "models" / "Qwen2.5-0.5B", "qwen2", 4096)
    config, unmapped = converted(tmp_path, capsys, "trl_sft_args.json")  # ds_zero3.json named by its deepspeed key
    assert config["name"] == "qwen2.5-0.5b-sft"
    assert config["model"] == {"path": "./models/Qwen2.5-0.5B"}
    assert config["optim"] == {"lr": 2e-5, "weight_decay": 0.01, "betas": [0.9, 0.95], "grad_clip": 1.0,
                               "warmup_steps": 30, "schedule": "cosine", "min_lr_ratio": 0.0}  # HF decays to 0
    assert config["train"] == {"run_dir": "outputs/qwen2.5-0.5b-sft", "steps": 600, "micro_batch_size": 4,
                               "grad_accum": 8, "seed": 42}
    assert config["data"] == {"sources": [{"hf_name": "trl-lib/Capybara", "field": "text"}], "seq_len": 2048}
    assert config["parallel"] == {"strategy": "zero3", "param_dtype": "bfloat16", "activation_checkpoint": "full"}
    assert config["checkpoint"] == {"every": 200, "keep_last": 2}
    assert config["metrics"] == {"log_every": 10}
    assert unmapped == [
        'report_to = "wandb": clustertrain logs to TensorBoard (metrics.tensorboard) and metrics.jsonl',
        "push_to_hub = false: no clustertrain key for it",
        "ds_zero3.json: zero_optimization.overlap_comm = true: no clustertrain key for it",
        "ds_zero3.json: zero_optimization.contiguous_gradients = true: no clustertrain key for it",
        "ds_zero3.json: zero_optimization.stage3_gather_16bit_weights_on_model_save = true: no clustertrain key "
        "for it",
        "ds_zero3.json: steps_per_print = 100: DeepSpeed's own log lines; metrics.log_every comes from logging_steps",
        "ds_zero3.json: wall_clock_breakdown = false: no clustertrain key for it"]
    line = checked(tmp_path, capsys, 8)
    assert "micro batch 4 × grad accum 8 × 8 dp ranks = global batch 256 sequences × 2048 tokens" in line


def test_explicit_deepspeed_values_win_over_training_arguments(tmp_path):
    (tmp_path / "c.yaml").write_text(convert(FIXTURES / "trl_sft_args.json", FIXTURES / "ds_zero2.json").to_yaml("x"))
    config = load_config(tmp_path / "c.yaml")
    assert (config.parallel.strategy, config.parallel.param_dtype, config.parallel.loss_scale) == \
        ("zero2", "float16", 4096.0)
    assert (config.train.micro_batch_size, config.train.grad_accum, config.train.steps) == (2, 16, 2000)
    assert (config.optim.lr, config.optim.betas, config.optim.grad_clip) == (1e-4, (0.9, 0.98), 0.5)
    assert (config.optim.schedule, config.optim.warmup_steps) == ("linear", 100)


def test_the_stub_s_keys_load_as_they_are(tmp_path):
    (tmp_path / "s.yaml").write_text("parallel:\n  sharding_stage: 3\n  zero3_hybrid: true\n")
    assert load_config(tmp_path / "s.yaml").parallel.strategy == "hybrid_zero3"
    assert load_config(None, ["parallel.strategy=zero3_hybrid"]).parallel.strategy == "hybrid_zero3"
    assert load_config(None, ["parallel.sharding_stage=2"]).parallel.strategy == "zero2"


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.sharding_stage=1"],
     "config error: parallel.sharding_stage = 1: use 0 (ddp), 2 (zero2) or 3 (zero3); ZeRO-1 shards only optimizer "
     "states: zero2 (stage 2) shards them with the gradients"),
    (["parallel.sharding_stage=2", "parallel.zero3_hybrid=true"],
     "config error: parallel.zero3_hybrid with sharding_stage = 2: zero3_hybrid is a ZeRO-3 form; set "
     "parallel.strategy: hybrid_zero2 for ZeRO-2 within a node"),
    (["parallel.sharding_stage=3", "parallel.strategy=ddp"],
     "config error: parallel.strategy = 'ddp' and parallel.sharding_stage = 3 (zero3_hybrid = false, which means "
     "'zero3') disagree; keep one"),
])
def test_stage_aliases_that_mean_none_of_ours_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert str(error.value) == message


@pytest.mark.parametrize(("text", "name", "message"), [
    ("foo: 1\n", "x.yaml", "neither TrainingArguments keys"),
    ('{"learning_rate": "fast"}', "a.json", "the converted config is refused: config error: optim.lr = 'fast'"),
    ("[training]\nsteps = 0\n", "t.toml", "config error: train.steps = 0: Input should be greater than 0"),
    ('{"learning_rate": 1e-4, "deepspeed": "nope.json"}', "a.json", "deepspeed = 'nope.json': no such file here or "
                                                                     "next to a.json"),
])
def test_what_cannot_be_converted_is_one_line(tmp_path, capsys, text, name, message):
    (tmp_path / name).write_text(text)
    assert main(["config", "convert", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(("value", "key"), [("Qwen/Qwen2.5-0.5B", "model.hub_id"), ("gpt2", "model.hub_id"),
                                            ("./models/x", "model.path"), ("/scratch/me/llama", "model.path")])
def test_a_model_name_is_a_hub_id_unless_it_is_a_path(tmp_path, value, key):
    (tmp_path / "a.json").write_text(f'{{"model_name_or_path": "{value}", "max_steps": 5}}')
    assert _flat(convert(tmp_path / "a.json").config)[key] == value


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "config":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_training_arguments_as_yaml_with_trl_s_lora_keys_and_epochs(tmp_path):
    (tmp_path / "sft.yaml").write_text(
        "model_name_or_path: Qwen/Qwen2-0.5B\nlearning_rate: 1.0e-4\nnum_train_epochs: 2\nwarmup_ratio: 0.1\n"
        "per_device_train_batch_size: 2\nuse_peft: true\nlora_r: 8\nlora_target_modules: [q_proj, v_proj]\n"
        "max_seq_length: 1024\n")
    conversion = convert(tmp_path / "sft.yaml")
    (tmp_path / "c.yaml").write_text(conversion.to_yaml("sft.yaml"))
    config = load_config(tmp_path / "c.yaml")
    assert (config.model.hub_id, config.data.seq_len) == ("Qwen/Qwen2-0.5B", 1024)
    assert (config.train.steps, config.train.epochs, config.train.micro_batch_size, config.train.grad_accum) == \
        (None, 2.0, 2, 1)
    assert (config.lora.rank, config.lora.alpha, config.lora.target_modules) == (8, 32, ["q_proj", "v_proj"])
    assert (config.optim.weight_decay, config.optim.betas, config.optim.schedule) == (0.0, (0.9, 0.999), "linear")
    assert conversion.unmapped == ["warmup_ratio = 0.1: a share of the steps, which epochs leave open; give "
                                   "optim.warmup_steps"]
