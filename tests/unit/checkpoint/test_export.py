from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM, AutoTokenizer

from clustertrain.checkpoint import export
from clustertrain.checkpoint.export import export_hf, import_hf, load_checkpoint_model
from clustertrain.cli import export_cmd
from clustertrain.errors import CheckpointError, UserError
from helpers import train

VOCAB = 512  # TINY's data.vocab_size, so the GPT-2 below can share the trained tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, shared_cache) -> Path:
    """One real 3-step training checkpoint of the tiny Llama, shared by the module."""
    run_dir = tmp_path_factory.mktemp("run")
    train(run_dir, "train.steps=3")
    return run_dir / "checkpoints" / "step-0000003"


@pytest.fixture(scope="module")
def trained(checkpoint):
    return load_checkpoint_model(checkpoint)


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory) -> Path:
    return export_hf(checkpoint, tmp_path_factory.mktemp("export") / "hf")


@pytest.fixture
def tiny_gpt2(tmp_path, checkpoint) -> tuple[Path, torch.nn.Module]:
    """A tied-embedding GPT-2 saved with save_pretrained, with a tokenizer, as a hub download would look."""
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    hf_dir = tmp_path / "gpt2"
    model.save_pretrained(hf_dir)
    AutoTokenizer.from_pretrained(checkpoint / "tokenizer").save_pretrained(hf_dir)
    return hf_dir, model


def inputs(vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_load_checkpoint_model_holds_the_saved_weights(checkpoint, trained):
    weights = trained[0].state_dict()
    saved = {"model": {key: torch.empty_like(value) for key, value in weights.items()}}
    dcp.load(saved, checkpoint_id=checkpoint)  # read independently of load_checkpoint_model
    assert weights.keys() == saved["model"].keys()
    assert all(torch.equal(weights[key], saved["model"][key]) for key in weights)


def test_export_gives_the_checkpoints_logits(trained, exported):
    model, _, config = trained
    assert config.model.arch == "llama" and not model.training
    reloaded = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    assert torch.equal(logits(reloaded, inputs()), logits(model, inputs()))


def test_export_writes_safetensors_config_and_tokenizer_only(trained, exported):
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not any(p.suffix in (".bin", ".pt", ".pth", ".distcp") for p in exported.iterdir())
    assert not list(exported.parent.glob(".tmp-*"))
    tokenizer = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    assert tokenizer("def f(x):").input_ids == trained[1]("def f(x):").input_ids


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_exported_files_are_as_readable_as_the_umask_says(checkpoint, tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        out = export_hf(checkpoint, tmp_path / "out", max_shard_size="100KB")
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert any(name.endswith(".safetensors") for name in modes)  # written through a private temporary file
    assert set(modes.values()) == {mode}, modes
    assert out.stat().st_mode & 0o777 == mode | 0o111 & ~umask


def test_sharded_export_writes_an_index_and_loads(checkpoint, trained, tmp_path):
    out = export_hf(checkpoint, tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((out / name).is_file() for name in shards)
    reloaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert torch.equal(logits(reloaded, inputs()), logits(trained[0], inputs()))


def test_gpt2_import_export_round_trip_keeps_ties_and_logits(tiny_gpt2, tmp_path):
    hf_dir, original = tiny_gpt2
    ckpt = import_hf(hf_dir, tmp_path / "ckpt")

    assert json.loads((ckpt / "train_state.json").read_text()) == {
        "step": 0, "tokens_seen": 0, "imported_from": str(hf_dir.resolve())
    }
    saved = FileSystemReader(ckpt).read_metadata().state_dict_metadata
    assert saved and all(key.startswith("model.") for key in saved)  # weights only, no optimizer state
    assert (ckpt / "tokenizer" / "tokenizer.json").is_file()

    model, tokenizer, config = load_checkpoint_model(ckpt)
    assert config.model.arch == "gpt2" and tokenizer is not None
    assert config.model.config["n_embd"] == 32 and "activation_function" not in config.model.config  # a default
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(logits(model, inputs()), logits(original, inputs()))

    out = export_hf(ckpt, tmp_path / "out")
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: stored once, as HF does
    reloaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert reloaded.config.tie_word_embeddings
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight
    assert torch.equal(logits(reloaded, inputs()), logits(original, inputs()))


def test_import_without_tokenizer_pins_a_small_vocab_and_drops_unknown_fields(tmp_path):
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=32, n_embd=32, n_layer=1, n_head=4, bos_token_id=0, eos_token_id=0, note="x"
    )
    original = AutoModelForCausalLM.from_config(config).eval()
    original.save_pretrained(tmp_path / "hf")
    ckpt = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert not (ckpt / "tokenizer").exists()
    model, tokenizer, run_config = load_checkpoint_model(ckpt)  # vocab 256 is below data.vocab_size's floor of 300
    assert tokenizer is None and "note" not in run_config.model.config  # unknown to GPT-2: dropped
    assert torch.equal(logits(model, inputs(256)), logits(original, inputs(256)))


def test_interrupted_import_leaves_nothing_under_the_final_name(tiny_gpt2, tmp_path, monkeypatch):
    def fail(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "dump_config", fail)
    with pytest.raises(KeyboardInterrupt):
        import_hf(tiny_gpt2[0], tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == [tiny_gpt2[0]]


def test_missing_or_incomplete_checkpoint_is_a_one_line_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint_model(tmp_path / "nowhere")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no train_state.json") as error:
        export_hf(tmp_path / "half", tmp_path / "out")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, message", [
    ("num_hidden_layers: 2", "has no model.layers.2"), ("intermediate_size: 128", "is (128, 64) in the checkpoint"),
])
def test_checkpoint_that_does_not_fit_its_config_is_a_one_line_error(checkpoint, tmp_path, change, message):
    copy = tmp_path / "step-0000003"
    shutil.copytree(checkpoint, copy)
    key, value = change.split(": ")
    config = copy / "config.yaml"
    config.write_text(config.read_text().replace(change, f"{key}: {int(value) + 1}"))
    with pytest.raises(CheckpointError, match=re.escape(message)) as error:
        load_checkpoint_model(copy)
    assert "\n" not in str(error.value)


def test_a_truncated_safetensors_file_is_one_line_wherever_it_is_read(exported, tmp_path):
    snapshot = tmp_path / "snapshot"
    shutil.copytree(exported, snapshot)
    weights = snapshot / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    from clustertrain.inference import load_for_inference
    from clustertrain.model.weights import load_pretrained

    model = AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(snapshot))
    for load in (lambda: import_hf(snapshot, tmp_path / "imported"), lambda: load_for_inference(snapshot),
                 lambda: load_pretrained(model, snapshot)):  # import, generate, train with model.path
        with pytest.raises(CheckpointError) as error:
            load()
        assert "incomplete metadata" in str(error.value) and "\n" not in str(error.value), error.value
    assert not (tmp_path / "imported").exists()


def test_non_empty_output_directory_is_refused(checkpoint, tiny_gpt2, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty"):
        export_hf(checkpoint, out)
    with pytest.raises(CheckpointError, match="not empty"):
        import_hf(tiny_gpt2[0], out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_import_of_a_folder_without_config_json_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        import_hf(tmp_path, tmp_path / "ckpt")


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="clustertrain")
    export_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


def test_cli_exports_a_run_directorys_newest_checkpoint_and_imports_it(checkpoint, trained, tmp_path, capsys):
    out = tmp_path / "hf"
    assert cli("export", str(checkpoint.parent.parent), str(out), "--max-shard-size", "200KB") == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and f'AutoModelForCausalLM.from_pretrained("{out}")' in line
    assert (out / "model.safetensors.index.json").is_file()

    assert cli("import", str(out), str(tmp_path / "ckpt")) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and str(tmp_path / "ckpt") in line
    model, _, _ = load_checkpoint_model(tmp_path / "ckpt")
    assert torch.equal(logits(model, inputs()), logits(trained[0], inputs()))

    with pytest.raises(UserError):
        cli("export", str(tmp_path / "nowhere"), str(tmp_path / "x"))


@pytest.fixture(scope="module")
def exported_bf16(checkpoint, tmp_path_factory) -> Path:
    return export_hf(checkpoint, tmp_path_factory.mktemp("export-bf16") / "hf", dtype=torch.bfloat16)


def test_a_bf16_export_is_bf16_on_disk_and_loads_with_the_checkpoints_logits(trained, exported_bf16):
    with safe_open(exported_bf16 / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    reloaded = AutoModelForCausalLM.from_pretrained(exported_bf16, local_files_only=True).eval()
    assert reloaded.dtype == torch.bfloat16
    expected = logits(trained[0], inputs())
    assert (logits(reloaded, inputs()).float() - expected).abs().max() < 0.02 * expected.abs().max()
    # exactly the checkpoint's weights rounded to bf16: read back in fp32, the same logits as those
    rounded = AutoModelForCausalLM.from_pretrained(exported_bf16, local_files_only=True, dtype=torch.float32)
    original = {k: v.to(torch.bfloat16).float() for k, v in trained[0].state_dict().items()}
    assert all(torch.equal(rounded.state_dict()[k], v) for k, v in original.items())


def test_export_defaults_to_the_runs_param_dtype(checkpoint, tmp_path):
    copy = tmp_path / "step-0000003"
    shutil.copytree(checkpoint, copy)
    config = copy / "config.yaml"
    assert "param_dtype: float32" in config.read_text()
    config.write_text(config.read_text().replace("param_dtype: float32", "param_dtype: float16"))
    out = export_hf(copy, tmp_path / "out")
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"


def test_export_reads_one_tensor_at_a_time(checkpoint, trained, tmp_path, monkeypatch):
    """Each read of the checkpoint asks for one tensor: the model is never whole in memory, nor is a shard."""
    from clustertrain.checkpoint import stream

    reads = []

    def recording(state, path, metadata):
        reads.append([t.numel() * t.element_size() for t in state["model"].values()])
        return load_state(state, path, metadata)

    load_state = stream.load_state
    monkeypatch.setattr(stream, "load_state", recording)
    out = export_hf(checkpoint, tmp_path / "out", max_shard_size="70KB", dtype=torch.bfloat16)
    whole = sum(v.numel() * 2 for v in trained[0].state_dict().values())
    assert len(list(out.glob("*.safetensors"))) > 3 and len(reads) == len(trained[0].state_dict())
    assert all(len(read) == 1 for read in reads) and sum(read[0] for read in reads) == whole


def test_exported_files_carry_the_keys_transformers_4_reads(exported):
    config = json.loads((exported / "config.json").read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 10000.0
    assert config["torch_dtype"] == config["dtype"] == "float32" and config["architectures"] == ["LlamaForCausalLM"]
    assert "rope_scaling" not in config  # default rope: 4.x reads no scaling
    tokenizer = json.loads((exported / "tokenizer_config.json").read_text())
    assert tokenizer["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_cli_refuses_an_unknown_dtype(checkpoint, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli("export", str(checkpoint), str(tmp_path / "out"), "--dtype", "bf8")
    assert exit_.value.code == 2 and "--dtype" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["inside", "named-like-one", "in-a-checkpoint"])
def test_export_into_a_checkpoints_folder_is_refused(checkpoint, tmp_path, where):
    """It would be taken for a checkpoint, or removed with the run's interrupted saves (`.tmp-step-N`)."""
    out = {"inside": checkpoint.parent / "hf",  # the run's own checkpoints/
           "named-like-one": tmp_path / "checkpoints" / "step-0000009",  # a fake checkpoints/step-N anywhere
           "in-a-checkpoint": checkpoint / "hf"}[where]
    before = sorted(p.name for p in checkpoint.parent.iterdir())
    with pytest.raises(CheckpointError, match=r"(inside the checkpoint|named like a checkpoint).*; export to a") as e:
        export_hf(checkpoint, out)
    assert "\n" not in str(e.value) and str(out) in str(e.value)
    assert not out.exists() and sorted(p.name for p in checkpoint.parent.iterdir()) == before


def test_merge_of_a_run_without_lora_is_refused(checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match=r"^--merge: .*step-0000003 is not a LoRA run, so there is no adapter "
                                              r"to merge; export it without --merge"):
        export_hf(checkpoint, tmp_path / "merged", merge=True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("errno_", "exit_code", "message"), [
    (errno.EACCES, 2, "cannot write {out}: permission denied in {parent}; choose a directory you can write to"),
    (errno.EROFS, 2, "cannot write {out}: read-only file system in {parent}; choose a directory you can write to"),
    (errno.ENOSPC, 74, "writing {out} failed: no space left on device in {parent}; the partial copy was removed "
                       "and nothing else changed: free space and run it again"),
], ids=["permission-denied", "read-only", "disk-full"])
def test_an_unwritable_directory_or_a_full_disk_is_one_line_and_leaves_no_partial_export(
        checkpoint, tmp_path, monkeypatch, capsys, errno_, exit_code, message):
    """The OS's answer stands in for a read-only mount (root ignores a directory's mode) or a full disk; a real
    full tmpfs gives the same line (docs/reliability.md)."""
    parent = tmp_path / "exports"
    out = parent / "hf"
    if errno_ == errno.ENOSPC:  # the disk fills while the weights are written
        real_open = open

        def full_disk(path, mode="r", *args, **kwargs):
            if "w" in mode and str(path).endswith(".safetensors"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return real_open(path, mode, *args, **kwargs)
        monkeypatch.setattr("builtins.open", full_disk)
    else:  # the folder the export is written into cannot be made
        real_mkdir = Path.mkdir

        def refused(self, *args, **kwargs):
            if self.parent == parent:
                raise OSError(errno_, os.strerror(errno_), str(self))
            return real_mkdir(self, *args, **kwargs)
        monkeypatch.setattr(Path, "mkdir", refused)
    from clustertrain.cli import main

    assert main(["export", str(checkpoint), str(out)]) == exit_code
    assert capsys.readouterr().err == "error: " + message.format(out=out, parent=parent) + "\n"
    assert not out.exists() and not any(parent.glob(".tmp-*"))
