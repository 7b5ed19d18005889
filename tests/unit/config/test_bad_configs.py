"""A table of bad configs: each exits 2 with one `error:` line naming the key, no traceback, and no run directory.

The table runs in-process through `clustertrain.cli.main` (nearly all of it fails inside `load_config`, before any
rank starts); two cases run as real processes to prove the exit code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from clustertrain.cli import main
from helpers import run_cli


@dataclass
class Bad:
    """One bad config: `--set` overrides, files written first (the first is the config), or a whole command."""

    key: str  # what the error line must name
    sets: tuple[str, ...] = ()
    files: dict[str, bytes] = field(default_factory=dict)
    argv: tuple[str, ...] | None = None  # instead of `train [CONFIG] --set ...`; {tmp} is the test's directory


def S(key: str, *sets: str) -> Bad:  # noqa: N802 - a table constructor
    return Bad(key, sets)


def F(key: str, name: str, text: str | bytes, *sets: str) -> Bad:  # noqa: N802
    return Bad(key, sets, {name: text if isinstance(text, bytes) else text.encode()})


GPT2 = "model.arch=gpt2"

# Local snapshots (model.path): only their config.json is read at config time.
SNAPSHOTS = {
    "llama": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "vocab_size": 512},
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 256, "vocab_size": 512},
    "gpt2-short": {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 32,
                   "vocab_size": 512},
    "bert": {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 128, "vocab_size": 512},
}


def SNAP(key: str, snapshot: str, *sets: str, config_json: bytes | None = None) -> Bad:  # noqa: N802
    """A run fine-tuning the local snapshot `snapshot` (a name of SNAPSHOTS, written as {tmp}/<name>/config.json)."""
    text = config_json if config_json is not None else json.dumps(SNAPSHOTS.get(snapshot, {})).encode()
    return Bad(key, (f"model.path={{tmp}}/{snapshot}", *sets), {f"{snapshot}/config.json": text})

# A "billion laughs" in a key that takes a list: 9 aliases of 9 aliases ... stand for 9^10 strings in 485 bytes.
BOMB = "slurm:\n  setup:\n    - &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"    - &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefghi", "bcdefghij"))
# A tokenizer folder whose tokenizer_config.json asks transformers to run its custom.py (which would leave RAN).
CODE = b"open('RAN', 'w').close()\n"
CODE_TOKENIZER = json.dumps({"tokenizer_class": "CustomTokenizer", "auto_map": {
    "AutoTokenizer": ["custom.CustomTokenizer", None]}}).encode()

CASES: dict[str, Bad] = {
    # ---- model: architecture -------------------------------------------------------------------
    "arch-bert": S("model.arch", "model.arch=bert"),
    "arch-roberta": S("model.arch", "model.arch=roberta"),
    "arch-bart": S("model.arch", "model.arch=bart"),
    "arch-t5": S("model.arch", "model.arch=t5"),
    "arch-vit": S("model.arch", "model.arch=vit"),
    "arch-unknown": S("model.arch", "model.arch=lama"),
    "arch-list": S("model.arch", "model.arch=[llama]"),
    # ---- model: config values the HF class or our shape checks refuse ----------------------------
    "hidden-not-divisible": S("model.config.hidden_size", "model.config.hidden_size=130"),
    "heads-not-dividing-hidden": S("model.config.hidden_size", "model.config.num_attention_heads=5"),
    "kv-heads-3": S("model.config.num_key_value_heads", "model.config.num_key_value_heads=3"),
    "kv-heads-above-heads": S("model.config.num_key_value_heads", "model.config.num_key_value_heads=8"),
    "hidden-negative": S("model.config.hidden_size", "model.config.hidden_size=-64"),
    "layers-zero": S("model.config.num_hidden_layers", "model.config.num_hidden_layers=0"),
    "heads-zero": S("model.config.num_attention_heads", "model.config.num_attention_heads=0"),
    "intermediate-negative": S("model.config.intermediate_size", "model.config.intermediate_size=-1"),
    "positions-zero": S("model.config.max_position_embeddings", "model.config.max_position_embeddings=0"),
    "vocab-negative": S("model.config.vocab_size", "model.config.vocab_size=-5"),
    "head-dim-zero": S("model.config.head_dim", "model.config.head_dim=0"),
    "hidden-float": S("model.config.hidden_size", "model.config.hidden_size=12.5"),
    "hidden-string": S("model.config.hidden_size", "model.config.hidden_size=abc"),
    "layers-bool": S("model.config.num_hidden_layers", "model.config.num_hidden_layers=true"),
    "seq-len-above-positions": S("max_position_embeddings", "data.seq_len=2048"),
    "activation-unknown": S("model.config.hidden_act", "model.config.hidden_act=swishy"),
    "eps-string": S("rms_norm_eps", "model.config.rms_norm_eps=abc"),
    "config-key-unknown": S("model.config.no_such_field", "model.config.no_such_field=1"),
    "config-key-typo": S("model.config.hidden_sise", "model.config.hidden_sise=64"),
    "config-list": S("model.config", "model.config=[1, 2]"),
    "config-scalar": S("model.config", "model.config=5"),
    "gpt2-positions-below-seq-len": S("model.config.n_positions", GPT2,
                                      "model.config={n_embd: 64, n_head: 4, n_positions: 64}"),
    "gpt2-embd-not-divisible": S("model.config.n_embd", GPT2, "model.config={n_embd: 65, n_head: 4}"),
    "gpt2-layers-zero": S("model.config.n_layer", GPT2, "model.config={n_layer: 0}"),
    "gpt2-heads-negative": S("model.config.n_head", GPT2, "model.config={n_head: -1}"),
    "gpt2-llama-key": S("model.config.num_key_value_heads", GPT2, "model.config={num_key_value_heads: 2}"),
    "opt-ffn-zero": S("model.config.ffn_dim", "model.arch=opt", "model.config={ffn_dim: 0}"),
    "attn-unknown": S("model.attn_implementation", "model.attn_implementation=flash"),
    "kernels-unknown": S("model.kernels", "model.kernels=triton"),
    "path-and-hub-id": S("model.path", "model.path=/x", "model.hub_id=org/m"),
    "model-scalar": S("model", "model=3"),
    "model-unknown-key": S("model.layers", "model.layers=4"),
    # ---- model: a local snapshot with model.config on top --------------------------------------
    "snapshot-layers-zero": SNAP("model.config.num_hidden_layers", "llama", "model.config={num_hidden_layers: 0}"),
    "snapshot-kv-heads-3": SNAP("model.config.num_key_value_heads", "llama", "model.config={num_key_value_heads: 3}"),
    "snapshot-heads-negative": SNAP("model.config.n_head", "gpt2", "model.config={n_head: -4}"),
    "snapshot-gpt2-short-context": SNAP("model.config.n_positions", "gpt2-short"),
    "snapshot-seq-len-above-positions": SNAP("max_position_embeddings", "llama", "data.seq_len=512"),
    "snapshot-unknown-key": SNAP("model.config.intermediate_size", "gpt2", "model.config={intermediate_size: 64}"),
    "snapshot-bert": SNAP("model.path", "bert"),
    "snapshot-lora-target": SNAP("lora.target_modules", "gpt2", "lora.rank=4", "lora.target_modules=[q_proj]"),
    "snapshot-config-not-json": SNAP("model.path", "broken", config_json=b"{\"model_type\": "),
    "snapshot-config-not-utf8": SNAP("model.path", "latin1", config_json=b'{"model_type": "gpt2", "x": "\xe9"}'),
    # ---- lora ----------------------------------------------------------------------------------
    "lora-rank-negative": S("lora.rank", "lora.rank=-1"),
    "lora-rank-bool": S("lora.rank", "lora.rank=true"),
    "lora-rank-string": S("lora.rank", "lora.rank=abc"),
    "lora-alpha-zero": S("lora.alpha", "lora.alpha=0"),
    "lora-dropout-one": S("lora.dropout", "lora.dropout=1.0"),
    "lora-dropout-negative": S("lora.dropout", "lora.dropout=-0.1"),
    "lora-targets-string": S("lora.target_modules", "lora.target_modules=all-layers"),
    "lora-target-missing": S("lora.target_modules", "lora.rank=4", "lora.target_modules=[nope]"),
    "lora-target-typo": S("lora.target_modules", "lora.rank=4", "lora.target_modules=[q_proj, qproj]"),
    "lora-target-gpt2": S("lora.target_modules", GPT2, "model.config={n_embd: 64, n_head: 4}", "lora.rank=4",
                          "lora.target_modules=[q_proj]"),
    "lora-unknown-key": S("lora.r", "lora.r=4"),
    # ---- data ----------------------------------------------------------------------------------
    "data-mode": S("data.mode", "data.mode=finetune"),
    "sources-empty": S("data.sources", "data.sources=[]"),
    "sources-scalar": S("data.sources", "data.sources=corpus.txt"),
    "source-path-and-hf": S("data.sources.0", "data.sources=[{path: a.txt, hf_name: b}]"),
    "source-neither": S("data.sources.0", "data.sources=[{}]"),
    "source-format": S("data.sources.0.format", "data.sources=[{path: a, format: xlsx}]"),
    "source-hf-format": S("data.sources.0", "data.sources=[{hf_name: x, format: jsonl}]"),
    "source-weight-zero": S("data.sources.0.weight", "data.sources=[{path: a, weight: 0}]"),
    "source-weight-bool": S("data.sources.0.weight", "data.sources=[{path: a, weight: true}]"),
    "source-unknown-key": S("data.sources.0.bogus", "data.sources=[{path: a, bogus: 1}]"),
    "source-text-unit": S("data.sources.0.text_unit", "data.sources=[{path: a, text_unit: sentence}]"),
    "source-token-dtype": S("data.sources.0.token_dtype", "data.sources=[{path: a, token_dtype: int8}]"),
    "source-max-bytes-zero": S("data.sources.0.max_bytes", "data.sources=[{format: stdlib, max_bytes: 0}]"),
    "source-split-list": S("data.sources.0.split", "data.sources=[{path: a, split: [1]}]"),
    "mix-by": S("data.mix_by", "data.mix_by=bytes"),
    "seq-len-zero": S("data.seq_len", "data.seq_len=0"),
    "seq-len-negative": S("data.seq_len", "data.seq_len=-1"),
    "seq-len-bool": S("data.seq_len", "data.seq_len=true"),
    "seq-len-float": S("data.seq_len", "data.seq_len=12.5"),
    "shuffle-buffer-zero": S("data.shuffle_buffer", "data.shuffle_buffer=0"),
    "doc-masking-word": S("data.doc_masking", "data.doc_masking=maybe"),
    "on-bad-data": S("data.on_bad_data", "data.on_bad_data=ignore"),
    "num-workers-negative": S("data.num_workers", "data.num_workers=-1"),
    "num-workers-bool": S("data.num_workers", "data.num_workers=false"),
    "vocab-too-small": S("data.vocab_size", "data.vocab_size=100"),
    "eval-fraction-half": S("data.eval_fraction", "data.eval_fraction=0.5"),
    "eval-fraction-negative": S("data.eval_fraction", "data.eval_fraction=-0.1"),
    "data-seed-string": S("data.seed", "data.seed=abc"),
    "data-seed-bool": S("data.seed", "data.seed=true"),
    "data-seed-negative": S("data.seed", "data.seed=-5"),
    "tokenizer-ships-code": Bad("never runs code from a model or tokenizer folder", ("data.tokenizer={tmp}/tok",),
                                {"tok/tokenizer_config.json": CODE_TOKENIZER, "tok/custom.py": CODE}),
    "audit-list": S("data.audit", "data.audit=[1]"),
    "data-unknown-key": S("data.seqlen", "data.seqlen=64"),
    # ---- optim ---------------------------------------------------------------------------------
    "lr-zero": S("optim.lr", "optim.lr=0"),
    "lr-negative": S("optim.lr", "optim.lr=-1"),
    "lr-inf": S("optim.lr", "optim.lr=.inf"),
    "lr-nan": S("optim.lr", "optim.lr=.nan"),
    "lr-bool": S("optim.lr", "optim.lr=true"),
    "lr-string": S("optim.lr", "optim.lr=fast"),
    "implementation": S("optim.implementation", "optim.implementation=apex"),
    "weight-decay-negative": S("optim.weight_decay", "optim.weight_decay=-0.1"),
    "weight-decay-inf": S("optim.weight_decay", "optim.weight_decay=.inf"),
    "betas-out-of-range": S("optim.betas", "optim.betas=[1.5, 0.9]"),
    "betas-negative": S("optim.betas", "optim.betas=[0.9, -1]"),
    "betas-one": S("optim.betas", "optim.betas=[0.9]"),
    "betas-scalar": S("optim.betas", "optim.betas=0.9"),
    "eps-zero": S("optim.eps", "optim.eps=0"),
    "grad-clip-negative": S("optim.grad_clip", "optim.grad_clip=-1"),
    "warmup-negative": S("optim.warmup_steps", "optim.warmup_steps=-1"),
    "warmup-bool": S("optim.warmup_steps", "optim.warmup_steps=true"),
    "schedule": S("optim.schedule", "optim.schedule=step"),
    "min-lr-ratio": S("optim.min_lr_ratio", "optim.min_lr_ratio=1.5"),
    "optim-unknown-key": S("optim.momentum", "optim.momentum=0.9"),
    # ---- train ---------------------------------------------------------------------------------
    "steps-true": S("train.steps", "train.steps=true"),
    "steps-false": S("train.steps", "train.steps=false"),
    "steps-zero": S("train.steps", "train.steps=0"),
    "steps-negative": S("train.steps", "train.steps=-5"),
    "steps-word": S("train.steps", "train.steps=ten"),
    "steps-float": S("train.steps", "train.steps=2.5"),
    "steps-list": S("train.steps", "train.steps=[1]"),
    "tokens-zero": S("train.tokens", "train.tokens=0"),
    "tokens-bool": S("train.tokens", "train.tokens=false"),
    "global-batch-zero": S("train.global_batch_size", "train.global_batch_size=0"),
    "global-batch-bool": S("train.global_batch_size", "train.global_batch_size=true"),
    "micro-batch-zero": S("train.micro_batch_size", "train.micro_batch_size=0"),
    "micro-batch-bool": S("train.micro_batch_size", "train.micro_batch_size=true"),
    "micro-above-global": S("micro_batch_size", "train.micro_batch_size=32"),
    "micro-above-small-global": S("micro_batch_size", "train.global_batch_size=2", "train.micro_batch_size=4"),
    "seed-bool": S("train.seed", "train.seed=true"),
    "seed-string": S("train.seed", "train.seed=abc"),
    "seed-negative": S("train.seed", "train.seed=-1"),
    "seed-past-64-bits": S("train.seed", "train.seed=18446744073709551616"),
    "seed-past-63-bits": S("train.seed", "train.seed=9223372036854775808"),
    "overwrite-word": S("train.overwrite", "train.overwrite=maybe"),
    "stop-after-zero": S("train.stop_after_steps", "train.stop_after_steps=0"),
    "walltime-word": S("walltime", "train.walltime=soon"),
    "walltime-bool": S("train.walltime", "train.walltime=true"),
    "walltime-margin-negative": S("train.walltime_margin", "train.walltime_margin=-1"),
    "on-nan": S("train.on_nan", "train.on_nan=ignore"),
    "eval-every-negative": S("train.eval_every", "train.eval_every=-1"),
    "eval-batches-zero": S("train.eval_batches", "train.eval_batches=0"),
    "sample-tokens-negative": S("train.sample_tokens", "train.sample_tokens=-1"),
    "loss": S("train.loss", "train.loss=fused"),
    "loss-chunk-zero": S("train.loss_chunk_tokens", "train.loss_chunk_tokens=0"),
    "resume-list": S("train.resume", "train.resume=[a]"),
    "epochs-and-tokens": S("train.epochs", "train.epochs=1", "train.tokens=1000"),
    "epochs-zero": S("train.epochs", "train.epochs=0"),
    "epochs-inf": S("train.epochs", "train.epochs=.inf"),
    "grad-accum-and-global": S("train.grad_accum", "train.grad_accum=2", "train.global_batch_size=8"),
    "grad-accum-zero": S("train.grad_accum", "train.grad_accum=0"),
    "loss-on": S("data.loss_on", "data.loss_on=prompt"),
    "eval-sources-empty": S("data.eval_sources", "data.eval_sources=[]"),
    "model-type-other-arch": S("model.config.model_type", "model.config={model_type: opt}"),
    "loss-scale-zero": S("parallel.loss_scale", "parallel.loss_scale=0"),
    "train-unknown-key": S("train.setps", "train.setps=10"),
    # ---- parallel ------------------------------------------------------------------------------
    "strategy": S("parallel.strategy", "parallel.strategy=fsdp"),
    "hybrid-shard-zero": S("parallel.hybrid_shard_size", "parallel.hybrid_shard_size=0"),
    "tp-zero": S("parallel.tp", "parallel.tp=0"),
    "tp-bool": S("parallel.tp", "parallel.tp=true"),
    "sequence-parallel-word": S("parallel.sequence_parallel", "parallel.sequence_parallel=sometimes"),
    "sequence-parallel-without-tp": S("parallel.sequence_parallel", "parallel.sequence_parallel=true"),
    "pp-negative": S("parallel.pp", "parallel.pp=-1"),
    "pp-schedule": S("parallel.pp_schedule", "parallel.pp_schedule=zb"),
    "pp-stages-zero": S("parallel.pp_stages_per_rank", "parallel.pp_stages_per_rank=0"),
    "microbatches-zero": S("parallel.microbatches", "parallel.microbatches=0"),
    "dp-shard-zero": S("parallel.dp_shard", "parallel.dp_shard=0"),
    "dp-replicate-negative": S("parallel.dp_replicate", "parallel.dp_replicate=-2"),
    "param-dtype": S("parallel.param_dtype", "parallel.param_dtype=float8"),
    "activation-checkpoint": S("parallel.activation_checkpoint", "parallel.activation_checkpoint=some"),
    "ac-every-zero": S("parallel.activation_checkpoint_every", "parallel.activation_checkpoint_every=0"),
    "compile-word": S("parallel.compile", "parallel.compile=maybe"),
    "reduce-dtype": S("parallel.reduce_dtype", "parallel.reduce_dtype=float16"),
    "backend": S("parallel.backend", "parallel.backend=mpi"),
    "device": S("parallel.device", "parallel.device=tpu"),
    "timeout-zero": S("parallel.timeout_minutes", "parallel.timeout_minutes=0"),
    "timeout-bool": S("parallel.timeout_minutes", "parallel.timeout_minutes=true"),
    "parallel-unknown-key": S("parallel.dp", "parallel.dp=2"),
    "eval-tasks-under-pp": S("train.eval_tasks", "train.eval_tasks=[arc_easy]", "parallel.pp=2"),
    "eval-tasks-limit-zero": S("train.eval_tasks_limit", "train.eval_tasks_limit=0"),
    "eval-tasks-not-a-list": S("train.eval_tasks", "train.eval_tasks={a: 1}"),
    # ---- watchdog ----------------------------------------------------------------------------
    "watchdog-after-collective": S("watchdog.step_timeout_s", "parallel.timeout_minutes=1"),
    "heartbeat-zero": S("watchdog.heartbeat_s", "watchdog.heartbeat_s=0"),
    "watchdog-factor-below-1": S("watchdog.step_timeout_factor", "watchdog.step_timeout_factor=0.5"),
    # ---- checkpoint ----------------------------------------------------------------------------
    "every-negative": S("checkpoint.every", "checkpoint.every=-1"),
    "every-bool": S("checkpoint.every", "checkpoint.every=true"),
    "keep-last-zero": S("checkpoint.keep_last", "checkpoint.keep_last=0"),
    "keep-last-string": S("checkpoint.keep_last", "checkpoint.keep_last=abc"),
    "keep-every-zero": S("checkpoint.keep_every", "checkpoint.keep_every=0"),
    "async-word": S("checkpoint.async", "checkpoint.async=sometimes"),
    "on-error": S("checkpoint.on_error", "checkpoint.on_error=ignore"),
    "checkpoint-unknown-key": S("checkpoint.keep", "checkpoint.keep=3"),
    # ---- metrics -------------------------------------------------------------------------------
    "log-every-zero": S("metrics.log_every", "metrics.log_every=0"),
    "log-every-bool": S("metrics.log_every", "metrics.log_every=true"),
    "tensorboard-word": S("metrics.tensorboard", "metrics.tensorboard=maybe"),
    "progress": S("metrics.progress", "metrics.progress=fancy"),
    "profile-one": S("metrics.profile", "metrics.profile=[1]"),
    "profile-word": S("metrics.profile", "metrics.profile=abc"),
    "peak-flops-zero": S("metrics.peak_flops", "metrics.peak_flops=0"),
    "metrics-unknown-key": S("metrics.comet", "metrics.comet=true"),
    "wandb-not-a-section": S("metrics.wandb", "metrics.wandb=true"),
    "wandb-mode": S("metrics.wandb.mode", "metrics.wandb.mode=cloud"),
    "wandb-unknown-key": S("metrics.wandb.project_name", "metrics.wandb.project_name=x"),
    "mlflow-enabled-word": S("metrics.mlflow.enabled", "metrics.mlflow.enabled=sometimes"),
    # ---- slurm ---------------------------------------------------------------------------------
    "nodes-zero": S("slurm.nodes", "slurm.nodes=0"),
    "nodes-bool": S("slurm.nodes", "slurm.nodes=true"),
    "gpus-negative": S("slurm.gpus_per_node", "slurm.gpus_per_node=-1"),
    "tasks-zero": S("slurm.tasks_per_node", "slurm.tasks_per_node=0"),
    "cpus-zero": S("slurm.cpus_per_task", "slurm.cpus_per_task=0"),
    "time-word": S("slurm.time", "slurm.time=forever"),
    "time-bool": S("slurm.time", "slurm.time=true"),
    "signal-before-small": S("slurm.signal_before", "slurm.signal_before=5"),
    "signal-before-above-time": S("signal_before", "slurm.time=00:30:00", "slurm.signal_before=3600"),
    "launcher": S("slurm.launcher", "slurm.launcher=mpirun"),
    "requeue": S("slurm.requeue", "slurm.requeue=always"),
    "max-restarts-negative": S("slurm.max_restarts", "slurm.max_restarts=-1"),
    "sbatch-time": S("slurm.time", "slurm.sbatch={time: '02:00:00'}"),
    "sbatch-t": S("slurm.time", "slurm.sbatch={t: 60}"),
    "sbatch-option-name": S("sbatch", "slurm.sbatch={'bad option': x}"),
    "sbatch-newline": S("slurm.sbatch.constraint", 'slurm.sbatch={constraint: "nvme\\n#SBATCH --x"}'),
    "job-name-newline": S("slurm.job_name", 'slurm.job_name="a\\nb"'),
    "env-name": S("env", "slurm.env={1BAD: x}"),
    "env-secret": S("env.HF_TOKEN", "slurm.env={HF_TOKEN: x}"),
    "modules-scalar": S("slurm.modules", "slurm.modules=5"),
    "slurm-unknown-key": S("slurm.gpus", "slurm.gpus=4"),
    "tasks-a-billion": S("slurm.tasks_per_node", "slurm.tasks_per_node=1000000000"),
    "gpus-a-billion": S("slurm.gpus_per_node", "slurm.gpus_per_node=1000000000"),
    "python-with-arguments": S("slurm.python", 'slurm.python=python3 -c "import os"'),
    "python-substitution": S("slurm.python", "slurm.python=$(touch MARKER)"),
    "python-tilde": S("slurm.python", "slurm.python=~/venv/bin/python"),
    "python-option": S("slurm.python", "slurm.python=-i"),
    # ---- top level and --set syntax ------------------------------------------------------------
    "name-list": S("name", "name=[1]"),
    "top-unknown-key": S("modle", "modle.arch=llama"),
    "section-scalar": S("optim", "optim=3"),
    "set-no-equals": S("override", "train.steps"),
    "set-empty-key": S("override", "=3"),
    "set-into-scalar": S("train.steps", "train.steps=3", "train.steps.x=3"),
    "set-below-scalar-section": S("override train.steps", "train=3", "train.steps=3"),
    "set-bad-yaml-value": S("optim.lr", "optim.lr=["),
    "set-duplicate-key": S("duplicate key 'hidden_size'", "model.config={hidden_size: 64, hidden_size: 128}"),
    # ---- files ---------------------------------------------------------------------------------
    "yaml-syntax": F("c.yaml", "c.yaml", "train: [1, 2\n"),
    "yaml-tab": F("c.yaml", "c.yaml", "train:\n\tsteps: 3\n"),
    "yaml-top-list": F("c.yaml", "c.yaml", "- 1\n- 2\n"),
    "yaml-top-scalar": F("c.yaml", "c.yaml", "hello\n"),
    "yaml-section-scalar": F("train", "c.yaml", "train: 5\n"),
    "yaml-steps-true": F("train.steps", "c.yaml", "train:\n  steps: true\n"),
    "yaml-steps-yes": F("train.steps", "c.yaml", "train:\n  steps: yes\n"),
    "yaml-arch-bert": F("model.arch", "c.yaml", "model:\n  arch: bert\n"),
    "yaml-unknown-section": F("trian", "c.yaml", "trian:\n  steps: 3\n"),
    "yaml-gpt2-short-context": F("model.config.n_positions", "c.yaml",
                                 "model:\n  arch: gpt2\n  config: {n_embd: 64, n_head: 4, n_positions: 32}\n"),
    "yaml-duplicate-top": F("duplicate key 'train'", "c.yaml", "train:\n  steps: 3\ntrain:\n  steps: 4\n"),
    "yaml-duplicate-nested": F("duplicate key 'steps' at line 3", "c.yaml", "train:\n  steps: 3\n  steps: 4\n"),
    "yaml-duplicate-flow": F("duplicate key 'hidden_size'", "c.yaml",
                             "model:\n  config: {hidden_size: 64, hidden_size: 96}\n"),
    "yaml-duplicate-in-list": F("duplicate key 'path'", "c.yaml",
                                "data:\n  sources:\n    - path: a.txt\n      path: b.txt\n"),
    "yaml-bomb": F("c.yaml: aliases expand past", "c.yaml", BOMB),
    "yaml-alias-in-itself": F("*a at line 4 is inside", "c.yaml", "model:\n  config: &a\n    hidden_size: 64\n"
                              "    x: *a\n"),
    "yaml-merge-then-duplicate": F("duplicate key 'steps' at line 4", "c.yaml",
                                   "train:\n  <<: {steps: 3}\n  steps: 4\n  steps: 5\n"),
    "yaml-nested-100000-deep": F("c.yaml: nested too deeply", "c.yaml",
                                 "slurm:\n  setup: " + "[" * 100_000 + "]" * 100_000),
    "yaml-not-utf8": F("not UTF-8", "c.yaml", b"train:\n  steps: 3 # caf\xe9\n"),
    "yaml-binary-run-dir": F("!!binary at line 2", "c.yaml", "train:\n  run_dir: !!binary cnVucy94\n"),
    "yaml-set-tag": F("!!set at line 1", "c.yaml", "name: !!set {a: null}\n"),
    "yaml-omap-tag": F("!!omap at line 2", "c.yaml", "slurm:\n  env: !!omap [{A: b}]\n"),
    "yaml-5-mib": F("c.yaml is 5 MiB", "c.yaml", "name: x\n" + "# padding\n" * 524_288),
    "yaml-120-deep": F("c.yaml: nested too deeply", "c.yaml", "model:\n  config: " + "{a: " * 120 + "1" + "}" * 120),
    "toml-50000-dotted": F("c.toml: nested too deeply", "c.toml", "[model.config]\n" + "x." * 50_000 + "y = 1\n"),
    "yaml-utf16": F("not UTF-8", "c.yaml", "train:\n  steps: 3\n".encode("utf-16")),
    "yml-not-utf8": F("c.yml", "c.yml", b"\xff\xfe\x00"),
    "toml-syntax": F("c.toml", "c.toml", "[train\nsteps = 3\n"),
    "toml-duplicate": F("c.toml", "c.toml", "[train]\nsteps = 3\nsteps = 4\n"),
    "toml-nested-100000-deep": F("c.toml: nested too deeply", "c.toml", "x = " + "[" * 100_000 + "]" * 100_000),
    "toml-duplicate-table": F("c.toml", "c.toml", "[train]\nsteps = 3\n[train]\nseed = 1\n"),
    "toml-not-utf8": F("not UTF-8", "c.toml", b"[train]\nrun_dir = \"r\xe9\"\n"),
    "toml-steps-true": F("train.steps", "c.toml", "[train]\nsteps = true\n"),
    "toml-unknown-key": F("optim.learning_rate", "c.toml", "[optim]\nlearning_rate = 0.1\n"),
    "toml-betas": F("optim.betas", "c.toml", "[optim]\nbetas = [1.5, 0.9]\n"),
    "unknown-extension": F("c.json", "c.json", '{"train": {"steps": 3}}'),
    "missing-file": Bad("config file not found", argv=("train", "{tmp}/nope.yaml")),
    "directory-as-file": Bad("is a directory; give the .yaml, .yml or .toml file in it", argv=("train", "{tmp}")),
    "device-as-file": Bad("config file /dev/null is not a regular file", argv=("config", "show", "/dev/null")),
    # ---- other commands ------------------------------------------------------------------------
    "config-show-bad-value": Bad("optim.lr", argv=("config", "show", "--set", "optim.lr=-1")),
    "render-bad-value": Bad("slurm.nodes", argv=("slurm", "render", "--set", "slurm.nodes=0")),
    "render-sbatch-time": Bad("slurm.time", argv=("slurm", "render", "--set", "slurm.sbatch={time: 60}")),
    "preset-not-utf8": Bad("not UTF-8", files={"p.yaml": b"modules: [caf\xe9]\n"},
                           argv=("slurm", "render", "--set", "slurm.preset={tmp}/p.yaml")),
    "preset-duplicate": Bad("duplicate key 'modules'", files={"p.yaml": b"modules: [a]\nmodules: [b]\n"},
                            argv=("slurm", "render", "--set", "slurm.preset={tmp}/p.yaml")),
    "preset-missing": Bad("slurm.preset", argv=("slurm", "render", "--set", "slurm.preset={tmp}/none.yaml")),
    "export-shard-garbage": Bad("--max-shard-size", argv=("export", "{tmp}/run", "{tmp}/out", "--max-shard-size",
                                                          "garbage")),
    "export-shard-zero": Bad("--max-shard-size", argv=("export", "{tmp}/run", "{tmp}/out", "--max-shard-size", "0")),
    "nproc-zero": Bad("--nproc", argv=("train", "--nproc", "0")),
}


def command(case: Bad, tmp: Path) -> list[str]:
    """The argv of a case, its files written to `tmp`, training pointed at `tmp/run`."""
    for name, data in case.files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
    if case.argv is not None:
        argv = [a.replace("{tmp}", str(tmp)) for a in case.argv]
    else:
        argv = ["train", *[str(tmp / name) for name in list(case.files)[:1] if "/" not in name]]
    if argv[0] == "train":  # the run directory first: a bad override after it is still what fails
        argv += ["--set", f"train.run_dir={tmp / 'run'}"]
    return argv + [f"--set={s.replace('{tmp}', str(tmp))}" for s in case.sets]


def assert_one_line(code: int, stderr: str, key: str) -> None:
    lines = stderr.strip().splitlines()
    assert code == 2, stderr
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, f"{len(lines)} lines:\n{stderr}"
    assert lines[0].startswith("error: "), lines[0]
    assert key in lines[0], f"{key!r} not named in: {lines[0]}"


def test_the_table_has_at_least_150_bad_configs():
    assert len(CASES) >= 150


@pytest.mark.parametrize("name", list(CASES))
def test_bad_config_is_one_line_and_exit_2(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default run directory (runs/<name>) would land here
    case = CASES[name]
    code = main(command(case, tmp_path))
    assert_one_line(code, capsys.readouterr().err, case.key)
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["steps-true", "yaml-duplicate-nested", "kv-heads-3"])
def test_bad_config_in_a_real_process(name, tmp_path):
    result = run_cli(*command(CASES[name], tmp_path), timeout=120)
    assert_one_line(result.returncode, result.stderr, CASES[name].key)
    assert not (tmp_path / "run").exists()


def test_eval_tasks_without_lm_eval_names_the_extra(monkeypatch):
    import importlib.util

    from clustertrain.errors import ConfigError
    from clustertrain.resolve.load import load_checked_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    with pytest.raises(ConfigError, match=r"train.eval_tasks needs lm-evaluation-harness: pip install 'clustertrain\[eval\]'"):
        load_checked_config(None, ["train.eval_tasks=[arc_easy]"])
    load_checked_config(None, [])  # without eval tasks, lm-eval is not needed
