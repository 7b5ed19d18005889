"""Fine-tuning a local HF snapshot with real ranks: LoRA under every strategy, frozen base, peft export, merge,
and training on from an imported snapshot."""

from __future__ import annotations

import json
import re
import shutil

import peft
import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from helpers import TINY, grad_norms, losses, run_cli, train
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from clustertrain.checkpoint.export import load_checkpoint_model
from clustertrain.config.load import load_config
from clustertrain.data.tokenize import load_tokenizer
from clustertrain.lora import hf_name
from clustertrain.run_dir import RunDir
from clustertrain.train.metrics import read_metrics
from clustertrain.train.status import read_status

pytestmark = pytest.mark.dist
# model.config={}: TINY's model fields would otherwise override the snapshot's config
LORA = ("model.config={}", "lora.rank=4", "lora.alpha=8", "optim.lr=1e-2", "optim.warmup_steps=0",
        "optim.schedule=constant")
STEPS = 8


TINY_ARCHS = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256),
    "opt": dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64,
                max_position_embeddings=256),
}


def make_snapshot(out, arch: str, sharpen: bool = False, dims: dict | None = None, seed: int = 0):
    """A tiny random `arch` model saved with save_pretrained, with the locally trained tokenizer of TINY's data."""
    tokenizer = load_tokenizer(load_config(None, TINY).data)
    config = AutoConfig.for_model(arch, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                  bos_token_id=tokenizer.bos_token_id, **(dims or TINY_ARCHS[arch]))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if sharpen:  # sharp logits: a loss far above a fresh init's ln(vocab), easy to tell apart
        with torch.no_grad():
            model.lm_head.weight.mul_(30)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    return make_snapshot(tmp_path_factory.mktemp("snapshot"), "llama", sharpen=True)


def assert_finished_with_a_sample(run_dir, result):
    """The run as users get it: exit 0 (checked by train), status finished, and the end-of-run sample shown."""
    assert read_status(RunDir(run_dir))["state"] == "finished"
    assert re.search(r"^ +sample  \s*\S", result.stdout, re.M), result.stdout[-2000:]  # from the run's data
    assert "sample failed" not in result.stdout


def assert_base_unchanged(run_dir, snapshot):
    """Every base weight of the run's checkpoint equals the snapshot's; returns the loaded model."""
    model, _, _ = load_checkpoint_model(run_dir)
    base = load_file(snapshot / "model.safetensors")
    trained = {hf_name(n): p for n, p in model.named_parameters() if ".lora_" not in n}
    prefix = model.get_base_model().base_model_prefix + "."
    for name, weight in base.items():
        name = name if name in trained else prefix + name
        assert torch.equal(trained[name], weight), name
    return model


@pytest.mark.parametrize("layout", [["parallel.strategy=ddp"], ["parallel.strategy=zero2"],
                                    ["parallel.strategy=zero3"],
                                    ["parallel.strategy=hybrid_zero2", "parallel.hybrid_shard_size=1"],
                                    ["parallel.strategy=zero3", "parallel.tp=2"]], ids=lambda o: "-".join(o)[18:])
def test_lora_learns_and_leaves_the_base_bit_identical(tmp_path, snapshot, layout):
    result = train(tmp_path, f"model.path={snapshot}", *LORA, f"train.steps={STEPS}", *layout,
                   "train.sample_tokens=4", nproc=2)
    assert_finished_with_a_sample(tmp_path, result)
    if "parallel.strategy=zero3" in layout:  # the sharded checkpoint, on its base, in one process
        generated = run_cli("generate", str(tmp_path), "--prompt", "def ", "--max-tokens", "4")
        assert generated.returncode == 0 and generated.stdout.strip(), generated.stderr[-2000:]
    curve = losses(tmp_path)
    assert curve[STEPS] < curve[1] - 0.05, curve
    model = assert_base_unchanged(tmp_path, snapshot)
    assert {hf_name(n) for n, _ in model.named_parameters() if ".lora_" not in n} == set(
        load_file(snapshot / "model.safetensors"))
    adapters = [n for n, p in model.named_parameters() if ".lora_B." in n]
    assert adapters and all(model.get_parameter(n).abs().sum() > 0 for n in adapters)  # B moved off zero


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_lora_keeps_its_frozen_base_in_the_compute_dtype(tmp_path, snapshot, strategy):
    """Under bf16 the frozen base is stored in bf16 (no fp32 copy); the adapters, which train, stay fp32. The
    checkpoint holds the adapters only; loaded, its base is the snapshot rounded to bf16, as training held it."""
    train(tmp_path, f"model.path={snapshot}", *LORA, f"train.steps={STEPS}", f"parallel.strategy={strategy}",
          "parallel.param_dtype=bfloat16", nproc=2)
    curve = losses(tmp_path)
    assert curve[STEPS] < curve[1] - 0.05, curve
    saved = dcp.FileSystemReader(tmp_path / "checkpoints" / f"step-{STEPS:07d}").read_metadata().state_dict_metadata
    dtypes = {name: meta.properties.dtype for name, meta in saved.items() if name.startswith("model.")}
    assert dtypes and all(".lora_" in n for n in dtypes) and set(dtypes.values()) == {torch.float32}
    model, _, _ = load_checkpoint_model(tmp_path)
    base = load_file(snapshot / "model.safetensors")
    trained = {hf_name(n): p for n, p in model.named_parameters() if ".lora_" not in n}
    assert all(torch.equal(trained[n], w.to(torch.bfloat16).float()) for n, w in base.items()), "base changed"


def test_lora_trains_the_same_under_activation_checkpointing(tmp_path, snapshot):
    """Recomputing blocks whose inputs need no gradient (frozen embeddings) still trains the adapters, identically."""
    for mode in ("none", "selective", "full"):
        train(tmp_path / mode, f"model.path={snapshot}", *LORA, "train.steps=4", "parallel.strategy=zero3",
              f"parallel.activation_checkpoint={mode}", nproc=2)
    assert losses(tmp_path / "full") == pytest.approx(losses(tmp_path / "none"), rel=1e-6)
    assert losses(tmp_path / "selective") == pytest.approx(losses(tmp_path / "none"), rel=1e-6)
    assert losses(tmp_path / "full")[4] < losses(tmp_path / "full")[1] - 0.05


@pytest.fixture(scope="module")
def lora_one_rank(snapshot, tmp_path_factory):
    """A 4-step LoRA fine-tune of the snapshot on one rank: what every layout must compute."""
    run_dir = tmp_path_factory.mktemp("lora-one-rank")
    train(run_dir, f"model.path={snapshot}", *LORA, "train.steps=4")
    return run_dir


@pytest.mark.parametrize("strategy", ["hybrid_zero2", "hybrid_zero3"])
def test_lora_under_a_hybrid_layout_matches_one_rank(tmp_path, snapshot, lora_one_rank, strategy):
    """2 shard groups of 2 ranks: the adapters are sharded within a group and replicated across the groups."""
    result = train(tmp_path, f"model.path={snapshot}", *LORA, "train.steps=4", f"parallel.strategy={strategy}",
                   "parallel.hybrid_shard_size=2", nproc=4)
    assert "dp_replicate=2, dp_shard=2" in result.stdout
    for measure in (losses, grad_norms):
        assert measure(tmp_path) == pytest.approx(measure(lora_one_rank), rel=1e-5), measure.__name__
    assert_base_unchanged(tmp_path, snapshot)


def test_training_resumes_from_an_imported_checkpoint(tmp_path, snapshot):
    """`clustertrain import` writes a step-0 checkpoint; `--resume` from it under zero3 on 2 ranks trains as a
    1-rank fine-tune of the same snapshot does (`model.path`)."""
    imported = tmp_path / "imported"
    result = run_cli("import", str(snapshot), str(imported))
    assert result.returncode == 0, result.stderr[-2000:]
    # the run describes the imported model: the snapshot's fields as import recorded them, not TINY's
    model = yaml.safe_load((imported / "config.yaml").read_text())["model"]["config"]
    train(tmp_path / "reference", f"model.path={snapshot}", "model.config={}", "train.steps=4")
    resumed = train(tmp_path / "run", f"model.config={json.dumps(model)}", "train.steps=4", "parallel.strategy=zero3",
                    nproc=2, extra_args=("--resume", str(imported)))
    assert f"resuming from {imported} at step 0" in resumed.stdout
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3, 4]
    for measure in (losses, grad_norms):
        assert measure(tmp_path / "run") == pytest.approx(measure(tmp_path / "reference"), rel=1e-5), measure.__name__


def test_adapter_export_loads_in_peft_and_merged_export_matches_it(tmp_path, snapshot):
    train(tmp_path / "run", f"model.path={snapshot}", *LORA, "train.steps=4", nproc=2)
    for args in (("adapter",), ("merged", "--merge")):
        result = run_cli("export", str(tmp_path / "run"), str(tmp_path / args[0]), *args[1:])
        assert result.returncode == 0, result.stderr
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    base = AutoModelForCausalLM.from_pretrained(snapshot)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, m = adapted(ids).logits, merged(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(snapshot).eval()(ids).logits
    assert torch.allclose(a, m, atol=1e-5, rtol=1e-5), (a - m).abs().max()
    assert not torch.allclose(a, plain, atol=1e-3)  # the adapter changes what the model computes


def test_full_fine_tune_starts_from_the_snapshot(tmp_path, snapshot):
    """Step 1's loss of a fine-tune equals the snapshot model's own loss on that batch: the weights were loaded."""
    train(tmp_path / "a", f"model.path={snapshot}", "model.config={}", "train.steps=1", "parallel.strategy=zero3",
          nproc=2)
    train(tmp_path / "b", f"model.path={snapshot}", "model.config={}", "train.steps=1", "lora.rank=4", nproc=2)
    assert losses(tmp_path / "a")[1] == pytest.approx(losses(tmp_path / "b")[1], rel=1e-5)
    train(tmp_path / "c", "train.steps=1", nproc=2)  # the same architecture from scratch starts near ln(512)
    assert losses(tmp_path / "b")[1] > losses(tmp_path / "c")[1] + 1.0


@pytest.mark.parametrize("arch", ["gpt2", "opt", "qwen2", "mistral"])
def test_each_architecture_loads_from_its_snapshot(tmp_path, arch):
    snapshot = make_snapshot(tmp_path / "snapshot", arch)
    train(tmp_path / "run", f"model.path={tmp_path / 'snapshot'}", *LORA, "train.steps=2")
    assert_base_unchanged(tmp_path / "run", snapshot)


def test_zero3_loads_a_model_bigger_than_one_ranks_share(tmp_path):
    """Each zero3 rank reads only its shards: loading grows a rank by about half the model, a full copy by all of it."""
    wide = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12,
                num_key_value_heads=12)  # a ~43M-parameter Llama: 170 MB of fp32 weights
    tokenizer = load_tokenizer(load_config(None, TINY).data)
    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, **wide)
    model = AutoModelForCausalLM.from_config(config)
    model_gb = sum(p.numel() for p in model.parameters()) * 4 / 1e9
    model.save_pretrained(tmp_path / "wide")
    tokenizer.save_pretrained(tmp_path / "wide")
    del model
    common = (f"model.path={tmp_path / 'wide'}", *LORA, "train.steps=1", "train.global_batch_size=2",
              "train.micro_batch_size=1", "data.seq_len=32")
    runs = {"tiny": ("train.steps=1",), "zero3": (*common, "parallel.strategy=zero3"), "ddp": common}
    peak = {}
    for name, overrides in runs.items():
        train(tmp_path / name, *overrides, nproc=1 if name == "ddp" else 2)
        peak[name] = next(r["load_mem_gb"] for r in read_metrics(tmp_path / name / "metrics.jsonl")
                          if "load_mem_gb" in r)
    sharded, whole = peak["zero3"] - peak["tiny"], peak["ddp"] - peak["tiny"]
    print(f"model {model_gb:.3f} GB; peak after loading, above a tiny model's: largest zero3 rank {sharded:.3f} GB, "
          f"one full copy {whole:.3f} GB")
    assert sharded < 0.75 * model_gb < whole


def test_shipped_sft_recipes_run_on_tiny_stand_ins(tmp_path, snapshot):
    rows = [{"text": f"<s>[INST] What is {a} plus {b}? [/INST] {a + b}. </s>"} for a in range(10) for b in range(10)]
    (tmp_path / "guanaco.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tiny = ("train.steps=3", "train.global_batch_size=4", "train.micro_batch_size=2", "data.seq_len=64",
            "parallel.param_dtype=float32", "train.sample_tokens=0", "metrics.progress=lines", "metrics.log_every=1")
    result = run_cli("train", "configs/lora-sft-llama3.yaml", "--nproc=2", *[f"--set={o}" for o in (
        f"model.path={snapshot}", f"data.sources=[{{path: {tmp_path / 'guanaco.jsonl'}, field: text}}]",
        f"train.run_dir={tmp_path / 'llama3'}", *tiny)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trainable" in result.stdout and len(losses(tmp_path / "llama3")) == 3

    gpt2 = make_snapshot(tmp_path / "gpt2", "gpt2")
    (tmp_path / "text").mkdir()
    for i in range(4):
        (tmp_path / "text" / f"{i}.txt").write_text("\n\n".join(f"Paragraph {i}.{j}: " + "words " * 40 for j in range(5)))
    result = run_cli("train", "configs/distilgpt2-lora-cpu.yaml", "--nproc=2", *[f"--set={o}" for o in (
        "model.hub_id=null", f"model.path={gpt2}", f"data.sources=[{{path: '{tmp_path / 'text'}/*.txt', "
        "text_unit: block}]", f"train.run_dir={tmp_path / 'gpt2-run'}", "train.eval_every=0", *tiny)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(losses(tmp_path / "gpt2-run")) == 3

    opt = make_snapshot(tmp_path / "opt", "opt")  # pipeline parallel + LoRA + float16, as the recipe sets
    result = run_cli("train", "configs/opt-pp-lora-cpu.yaml", "--nproc=2", *[f"--set={o}" for o in (
        "model.hub_id=null", f"model.path={opt}", f"data.sources=[{{path: '{tmp_path / 'text'}/*.txt', "
        "text_unit: block}]", f"train.run_dir={tmp_path / 'opt-run'}", "train.eval_every=0",
        *[o for o in tiny if not o.startswith("parallel.param_dtype")], "parallel.microbatches=2")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(losses(tmp_path / "opt-run")) == 3


def test_hub_id_resolves_in_the_offline_cache_that_download_filled(tmp_path, snapshot):
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    fetched = run_cli("download", "lab/tiny-llama", "--from-dir", str(snapshot), env=env)
    assert fetched.returncode == 0, fetched.stderr
    assert "model.hub_id: lab/tiny-llama" in fetched.stdout
    result = run_cli("train", *[f"--set={o}" for o in (*TINY, *LORA, "model.hub_id=lab/tiny-llama", "train.steps=1",
                                                        f"train.run_dir={tmp_path / 'run'}")], env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_base_unchanged(tmp_path / "run", snapshot)
    missing = run_cli("train", "--set=model.hub_id=lab/absent", f"--set=train.run_dir={tmp_path / 'x'}", env=env)
    assert missing.returncode == 2 and "clustertrain download lab/absent" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1


# A base about 20x its adapter: 1.44M parameters against a rank-9 adapter on every linear layer (74k). Wide enough
# that the adapter outweighs what every checkpoint holds besides (DCP's few hundred bytes per tensor, RNG states,
# tokenizer, config: about 0.5 MB here).
WIDE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
WIDE_LORA = ("model.config={}", "lora.rank=9", "lora.alpha=18", "optim.lr=1e-2", "optim.warmup_steps=0",
             "train.steps=10", "checkpoint.every=2")


@pytest.fixture(scope="module")
def wide_snapshot(tmp_path_factory):
    return make_snapshot(tmp_path_factory.mktemp("wide"), "llama", dims=WIDE)


@pytest.fixture(scope="module")
def wide_reference(wide_snapshot, tmp_path_factory):
    """10 uninterrupted LoRA steps on 2 zero3 ranks, saving every 2."""
    run_dir = tmp_path_factory.mktemp("wide-reference")
    train(run_dir, f"model.path={wide_snapshot}", *WIDE_LORA, "parallel.strategy=zero3", nproc=2)
    return run_dir


def folder_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_a_lora_checkpoint_holds_the_adapter_and_a_reference_to_its_base(wide_snapshot, wide_reference):
    model, _, _ = load_checkpoint_model(wide_reference)
    base = sum(p.numel() for n, p in model.named_parameters() if ".lora_" not in n)
    adapter = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    adapter_and_adam = adapter * 4 * 3  # fp32 weights, exp_avg and exp_avg_sq
    step = wide_reference / "checkpoints" / "step-0000010"
    size = folder_bytes(step)
    print(f"base {base} params, adapter {adapter} ({base / adapter:.1f}x); checkpoint folder {size} bytes, adapter + "
          f"Adam state {adapter_and_adam} bytes, the base alone in fp32 {base * 4} bytes")
    assert 18 < base / adapter < 22
    assert size <= 2 * adapter_and_adam
    saved = dcp.FileSystemReader(step).read_metadata().state_dict_metadata
    assert {k for k in saved if k.startswith("model.")} == {f"model.{n}" for n, p in model.named_parameters()
                                                           if ".lora_" in n}
    reference = json.loads((step / "train_state.json").read_text())["base"]
    assert reference["path"] == str(wide_snapshot.resolve()) and len(reference["checksum"]) == 32


def test_a_lora_run_resumes_on_other_layouts_as_if_uninterrupted(tmp_path, wide_snapshot, wide_reference):
    """Saved by 2 zero3 ranks, resumed by 1 DDP rank, then 2 zero2 ranks, 2 hybrid ranks (2 replicas), and tensor
    parallel on 2 ranks: 2 steps each."""
    run = tmp_path / "moved"
    legs = [(["parallel.strategy=zero3"], 2), (["parallel.strategy=ddp"], None), (["parallel.strategy=zero2"], 2),
            (["parallel.strategy=hybrid_zero2", "parallel.hybrid_shard_size=1"], 2),
            (["parallel.strategy=zero3", "parallel.tp=2"], 2)]
    for i, (layout, nproc) in enumerate(legs):
        result = train(run, f"model.path={wide_snapshot}", *WIDE_LORA, *layout, "train.stop_after_steps=2",
                       nproc=nproc, state="stopped" if i < len(legs) - 1 else "finished")
        if i:
            assert f"at step {2 * i}" in result.stdout
    ours, theirs = losses(run), losses(wide_reference)
    assert sorted(ours) == list(range(1, 11))
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert ours[10] < ours[1] - 0.05


def test_resuming_on_another_base_is_one_line(tmp_path, wide_snapshot, wide_reference):
    other = make_snapshot(tmp_path / "other", "llama", dims=WIDE, seed=1)  # the same shapes, other weights
    run = tmp_path / "run"
    shutil.copytree(wide_reference / "checkpoints", run / "checkpoints")
    result = train(run, f"model.path={other}", *WIDE_LORA, "parallel.strategy=zero3", nproc=2, expect=2)
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]  # once, not per rank
    assert len(error) == 1 and str(wide_snapshot.resolve()) in error[0] and str(other) in error[0], result.stderr
    assert "Traceback" not in result.stderr


def test_lora_exports_read_their_base_from_the_reference(tmp_path, wide_snapshot, wide_reference):
    """The adapter in bf16 loads in peft, the merged model in bf16 in transformers, both computing what the
    checkpoint does (within bf16's rounding); a base that moved is one line naming it."""
    for args in (("adapter", "--dtype", "bf16"), ("merged", "--merge", "--dtype", "bf16")):
        result = run_cli("export", str(wide_reference), str(tmp_path / args[0]), *args[1:], cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(wide_snapshot.resolve())
    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    checkpoint, _, _ = load_checkpoint_model(wide_reference)
    adapted = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(wide_snapshot),
                                             tmp_path / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert merged.dtype == torch.bfloat16
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = checkpoint(ids).logits
        for model in (adapted, merged):
            assert (model(ids).logits.float() - expected).abs().max() < 0.02 * expected.abs().max()  # measured 0.005

    moved = tmp_path / "step"
    shutil.copytree(wide_reference / "checkpoints" / "step-0000010", moved)
    state = json.loads((moved / "train_state.json").read_text())
    state["base"]["path"] = str(tmp_path / "gone")
    (moved / "train_state.json").write_text(json.dumps(state))
    result = run_cli("generate", str(moved), "--prompt", "def ")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert str(tmp_path / "gone") in result.stderr
