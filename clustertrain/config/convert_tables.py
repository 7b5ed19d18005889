"""The key tables of `clustertrain config convert`: torchtitan, HF/TRL TrainingArguments, DeepSpeed, the stub.

A rule is a clustertrain key (the value copied) or a function of the value returning clustertrain keys and
values, raising Unmapped with the reason when the value has no counterpart. What depends on several keys at
once (the parallel strategy, epochs or steps, a minimum lr given as a value) is done by clustertrain.config.convert.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any



class Unmapped(Exception):
    """A key or value with no clustertrain counterpart; the message says why or what to set instead."""


def choice(target: str, values: dict[Any, Any], why: str = "") -> Callable[[Any], dict[str, Any]]:
    """The value looked up (strings case-blind) in `values`: {target: found}, or {} where found is None."""
    def rule(value: Any) -> dict[str, Any]:
        key = value.lower() if isinstance(value, str) else value
        if key not in values:
            raise Unmapped(why or f"no counterpart; {target} takes {', '.join(str(v) for v in values.values() if v)}")
        return {} if values[key] is None else {target: values[key]}
    return rule


def accepted(*values: Any, why: str = "clustertrain does otherwise") -> Callable[[Any], dict[str, Any]]:
    """Values that are what clustertrain does anyway (nothing to set); any other is unmapped."""
    return choice("", {(v.lower() if isinstance(v, str) else v): None for v in values}, why)


def positive(target: str) -> Callable[[Any], dict[str, Any]]:
    """The value where it is above 0; 0 or -1 ("not set", "all") leaves clustertrain's default."""
    return lambda value: {target: value} if isinstance(value, (int, float)) and value > 0 else {}


def unmapped(why: str) -> Callable[[Any], dict[str, Any]]:
    def rule(value: Any) -> dict[str, Any]:
        raise Unmapped(why)
    return rule


def is_path(value: Any) -> bool:
    """Whether a model or dataset name is a local path: it starts with /, ., ~ or $ (`$SCRATCH_ROOT/...`), or has
    more than one /; anything else (`gpt2`, `Qwen/Qwen2.5-0.5B`) is a hub id."""
    text = str(value)
    return text.startswith(("/", ".", "~", "$")) or text.count("/") > 1


def model_source(value: Any) -> dict[str, Any]:
    """model.path for a local directory (is_path), else model.hub_id."""
    return {"model.path" if is_path(value) else "model.hub_id": str(value)}


DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "fp32": "float32",
          "float32": "float32", "float": "float32", "half": "float16"}
SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "constant", "constant_with_warmup": "constant",
             "warmuplr": "constant", "warmupdecaylr": "linear", "warmupcosinelr": "cosine"}
ADAMW = accepted("adamw", "adam", "adamw_torch", "adamw_torch_fused", "adamw_hf", "fusedadam",
                 why="clustertrain trains with AdamW only")
MODEL_NAMES = {"llama3": "llama", "llama2": "llama", "llama": "llama", "qwen3": "qwen3", "qwen2": "qwen2",
               "mistral": "mistral", "gpt2": "gpt2"}
NO_CP = accepted(1, why="no context parallelism in clustertrain; split the sequence over fewer, longer steps")
PP_SCHEDULES = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved1f1b": "interleaved_1f1b"}

TORCHTITAN: dict[str, Any] = {
    "job.dump_folder": "train.run_dir",
    "model.name": choice("model.arch", MODEL_NAMES),
    "model.flavor": lambda v: {},  # the sizes of model.name's flavor: FINISH
    "model.hf_assets_path": "data.tokenizer",
    "optimizer.name": ADAMW,
    "optimizer.lr": "optim.lr",
    "optimizer.eps": "optim.eps",
    "optimizer.weight_decay": "optim.weight_decay",
    "optimizer.beta1": "optim.betas.0",
    "optimizer.beta2": "optim.betas.1",
    "optimizer.implementation": choice("optim.implementation", {"fused": "fused", "foreach": "foreach"}),
    "lr_scheduler.warmup_steps": "optim.warmup_steps",
    "lr_scheduler.decay_type": choice("optim.schedule", SCHEDULES),
    "lr_scheduler.min_lr_factor": "optim.min_lr_ratio",
    "lr_scheduler.lr_min": "optim.min_lr_ratio",
    "lr_scheduler.decay_ratio": unmapped("clustertrain decays from the end of warmup to the last step"),
    "training.steps": "train.steps",
    "training.seq_len": "data.seq_len",
    "training.local_batch_size": "train.micro_batch_size",
    "training.batch_size": "train.micro_batch_size",
    "training.global_batch_size": positive("train.global_batch_size"),
    "training.max_norm": "optim.grad_clip",
    "training.seed": "train.seed",
    "debug.seed": "train.seed",
    "training.mixed_precision_param": choice("parallel.param_dtype", DTYPES),
    "training.mixed_precision_reduce": choice("parallel.reduce_dtype", {"float32": "float32", "bfloat16": "bfloat16"}),
    "training.compile": "parallel.compile",
    "training.dataset_path": "data.sources.0.path",
    "training.dataset": unmapped("a torchtitan dataset name; give data.sources (path or hf_name)"),
    "parallelism.data_parallel_replicate_degree": lambda v: {},  # the strategy: FINISH
    "parallelism.data_parallel_shard_degree": lambda v: {},
    "parallelism.fsdp_reshard_after_forward": accepted("default", "always", "never"),
    "parallelism.tensor_parallel_degree": "parallel.tp",
    "parallelism.pipeline_parallel_degree": "parallel.pp",
    "parallelism.pipeline_parallel_schedule": choice("parallel.pp_schedule", PP_SCHEDULES),
    "parallelism.context_parallel_degree": NO_CP,
    "checkpoint.enable_checkpoint": lambda v: {},  # with checkpoint.interval: FINISH
    "checkpoint.enable": lambda v: {},
    "checkpoint.interval": lambda v: {},
    "checkpoint.keep_latest_k": lambda v: {"checkpoint.keep_last": v if v > 0 else None},
    "checkpoint.async_mode": choice("checkpoint.async", {"disabled": False, "async": True,
                                                         "async_with_pinned_mem": True}),
    "checkpoint.folder": unmapped("checkpoints are written to <train.run_dir>/checkpoints"),
    "activation_checkpoint.mode": choice("parallel.activation_checkpoint",
                                         {"none": "none", "full": "full", "selective": "selective"}),
    "activation_checkpoint.selective_ac_option": lambda v: (
        {} if str(v) == "op" or str(v).isdigit() and int(v) > 0 else _raise(
            "'op' (op-level: selective) or a stride N > 0 (every N-th block: every_n)")),  # torchtitan_checkpointing
    "compile.enable": "parallel.compile",
    "compile.components": lambda v: {} if set(v) <= {"model", "loss"} else _raise("clustertrain compiles blocks"),
    "metrics.log_freq": "metrics.log_every",
    "metrics.enable_tensorboard": "metrics.tensorboard",
    "validation.enable": lambda v: {} if v else {"train.eval_every": 0},
    "validation.enabled": lambda v: {} if v else {"train.eval_every": 0},
    "validation.freq": "train.eval_every",
    "validation.steps": positive("train.eval_batches"),
}
# Older torchtitan (early 2025, as the Frontier fork's train_configs/*.toml): the degrees, warmup and batch in
# [training], pipeline and context degrees in [experimental], the tokenizer as a file in [model].
TORCHTITAN.update({f"training.{key.split('.')[1]}": rule for key, rule in TORCHTITAN.items()
                   if key.startswith("parallelism.")})
TORCHTITAN.update({
    "training.warmup_steps": "optim.warmup_steps",
    "experimental.pipeline_parallel_degree": "parallel.pp",
    "experimental.pipeline_parallel_schedule": choice("parallel.pp_schedule", PP_SCHEDULES),
    "experimental.context_parallel_degree": NO_CP,
    "model.norm_type": accepted("rmsnorm", "fused_rmsnorm", why="clustertrain builds the HF model as it is, whose "
                                "Llama norm is RMSNorm"),
    "model.tokenizer_path": unmapped("a tiktoken tokenizer.model; give data.tokenizer an HF tokenizer folder "
                                     "(tokenizer.json, as the HF snapshot holds)"),
    "checkpoint.interval_type": accepted("steps", why="clustertrain saves every checkpoint.every steps"),
    "checkpoint.model_weights_only": accepted(False, why="clustertrain's checkpoints hold what a resume needs; "
                                              "`clustertrain export` writes the weights alone"),
    "float8.enable_float8_linear": accepted(False, why="no float8 training in clustertrain"),
})

HF: dict[str, Any] = {
    "run_name": "name",
    "output_dir": "train.run_dir",
    "model_name_or_path": model_source,
    "learning_rate": "optim.lr",
    "weight_decay": "optim.weight_decay",
    "adam_beta1": "optim.betas.0",
    "adam_beta2": "optim.betas.1",
    "adam_epsilon": "optim.eps",
    "max_grad_norm": "optim.grad_clip",
    "optim": lambda v: {"optim.implementation": "fused"} if v == "adamw_torch_fused" else ADAMW(v),
    "lr_scheduler_type": choice("optim.schedule", SCHEDULES),
    "lr_scheduler_kwargs.min_lr_rate": "optim.min_lr_ratio",
    "lr_scheduler_kwargs.min_lr": lambda v: {},  # a value, not a ratio: FINISH
    "warmup_steps": "optim.warmup_steps",
    "warmup_ratio": lambda v: {},  # of the steps: FINISH
    "max_steps": positive("train.steps"),
    "num_train_epochs": lambda v: {},  # unless max_steps: FINISH
    "per_device_train_batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "seed": "train.seed",
    "data_seed": "data.seed",
    "bf16": lambda v: {"parallel.param_dtype": "bfloat16"} if v else {},
    "fp16": lambda v: {"parallel.param_dtype": "float16"} if v else {},
    "tf32": accepted(True, None, why="clustertrain uses TF32 matmuls on CUDA in float32"),
    "gradient_checkpointing": lambda v: {"parallel.activation_checkpoint": "full" if v else "none"},
    "torch_compile": "parallel.compile",
    "save_strategy": choice("checkpoint.every", {"steps": None, "no": 0},
                            why="clustertrain saves every checkpoint.every steps"),
    "save_steps": lambda v: {"checkpoint.every": v} if isinstance(v, int) else _raise(
        "a fraction of the run; give checkpoint.every in steps"),
    "save_total_limit": "checkpoint.keep_last",
    "logging_steps": lambda v: {"metrics.log_every": v} if isinstance(v, int) else _raise("give metrics.log_every"),
    "eval_strategy": choice("train.eval_every", {"steps": None, "no": 0}),
    "evaluation_strategy": choice("train.eval_every", {"steps": None, "no": 0}),
    "eval_steps": lambda v: {"train.eval_every": v} if isinstance(v, int) else _raise("give train.eval_every"),
    "report_to": lambda v: _report_to([v] if isinstance(v, str) else list(v)),
    "do_train": accepted(True),
    # TRL's SFTConfig and its script's ModelConfig / ScriptArguments
    "max_seq_length": "data.seq_len",
    "max_length": "data.seq_len",
    "packing": accepted(True, why="clustertrain always packs examples into full sequences"),
    "dataset_text_field": "data.sources.0.field",
    "dataset_name": lambda v: {"data.sources.0.path" if is_path(v) else "data.sources.0.hf_name": v},
    "dataset_config": "data.sources.0.hf_config",
    "dataset_train_split": "data.sources.0.split",
    "use_peft": lambda v: {},  # with lora_r: FINISH
    "lora_r": lambda v: {},
    "lora_alpha": lambda v: {},
    "lora_dropout": lambda v: {},
    "lora_target_modules": lambda v: {},
    "deepspeed": lambda v: {},  # read as the DeepSpeed JSON
}

DEEPSPEED: dict[str, Any] = {
    "zero_optimization.stage": lambda v: {} if v in (0, 2, 3) else _raise(
        "ZeRO-1 has no strategy here; zero2 (stage 2) is the nearest: parallel.strategy: zero2"),
    "zero_optimization.zero_hpz_partition_size": lambda v: {},  # a hybrid strategy: FINISH
    "zero_optimization.offload_optimizer.device": accepted("none", why="no CPU/NVMe offload in clustertrain"),
    "zero_optimization.offload_param.device": accepted("none", why="no CPU/NVMe offload in clustertrain"),
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "train_batch_size": lambda v: {},  # where no accumulation is given: FINISH
    "gradient_clipping": "optim.grad_clip",
    "bf16.enabled": lambda v: {"parallel.param_dtype": "bfloat16"} if v else {},
    "fp16.enabled": lambda v: {"parallel.param_dtype": "float16"} if v else {},
    "fp16.initial_scale_power": lambda v: {"parallel.loss_scale": 2.0 ** v},
    "fp16.loss_scale": accepted(0, why="clustertrain's float16 loss scale is dynamic"),
    "optimizer.type": ADAMW,
    "optimizer.params.lr": "optim.lr",
    "optimizer.params.betas": "optim.betas",
    "optimizer.params.eps": "optim.eps",
    "optimizer.params.weight_decay": "optim.weight_decay",
    "scheduler.type": choice("optim.schedule", SCHEDULES),
    "scheduler.params.warmup_num_steps": "optim.warmup_steps",
    "scheduler.params.total_num_steps": "train.steps",
    "scheduler.params.warmup_max_lr": "optim.lr",
    "scheduler.params.warmup_min_lr": accepted(0, 0.0, why="warmup starts from 0"),
    "scheduler.params.warmup_type": accepted("linear", why="warmup is linear"),
    "scheduler.params.cos_min_ratio": "optim.min_lr_ratio",
    "steps_per_print": unmapped("DeepSpeed's own log lines; metrics.log_every comes from logging_steps"),
    "tensorboard.enabled": "metrics.tensorboard",
}

# The training stub's YAML as its documentation prints it (sections dist, dataset, model, optim, lr_scheduler,
# checkpoint); batch_size is per rank (the DDP way), and checkpoints go to <directory>/<prefix>.<timestamp>.
STUB_STRATEGIES = {"zero0": "ddp", "zero2": "zero2", "zero3": "zero3", "zero2_hybrid": "hybrid_zero2",
                   "zero3_hybrid": "hybrid_zero3"}
STUB: dict[str, Any] = {
    "dist.cpu_only": lambda v: {"parallel.device": "cpu"} if v else {},
    "dist.backend": choice("parallel.backend", {"nccl": None, "gloo": "gloo"},
                           why="clustertrain runs nccl (RCCL on ROCm) on GPUs and gloo on CPU"),
    "dist.dtype": choice("parallel.param_dtype", DTYPES),
    "dist.sharding_stage": choice("parallel.strategy", STUB_STRATEGIES,
                                  why="use zero0 (ddp), zero2, zero3, zero2_hybrid or zero3_hybrid; zero2 is the "
                                  "nearest to zero1 (ZeRO-1 shards only optimizer states)"),
    "dataset.batch_size": "train.micro_batch_size",
    "dataset.num_workers": "data.num_workers",
    "dataset.path_train": "data.sources.0.path",
    "dataset.path_eval": "data.eval_sources.0.path",
    "model.hf_config.model_type": "model.arch",
    "model.hf_config.*": lambda v: {},  # all of them as model.config: FINISH
    "optim.lr": "optim.lr",
    "optim.weight_decay": "optim.weight_decay",
    "lr_scheduler.total_iterations": "train.steps",
    "lr_scheduler.warmup_iterations": "optim.warmup_steps",
    "checkpoint.state_dict_type": accepted("sharded", why="clustertrain saves sharded checkpoints (each rank its "
                                           "shard, resumable on any rank count); `clustertrain export` writes the "
                                           "full weights"),
    "checkpoint.chkpt_saving_iterations": "checkpoint.every",
    "checkpoint.directory": lambda v: {},  # with the prefix, the run directory: FINISH
    "checkpoint.prefix": "name",
}

RULES = {"torchtitan": TORCHTITAN, "hf": HF, "deepspeed": DEEPSPEED, "stub": STUB}
HF_MARKERS = {"learning_rate", "per_device_train_batch_size", "num_train_epochs", "max_steps", "lr_scheduler_type",
              "save_steps", "max_seq_length", "max_length"}
STUB_SECTIONS = {"dist", "dataset", "model", "optim", "lr_scheduler", "checkpoint"}  # mappings, in the stub
DEEPSPEED_MARKERS = {"zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size", "gradient_clipping"}


def torchtitan_checkpointing(flat: dict[str, Any], targets: dict[str, Any]) -> None:
    """torchtitan's `selective` is op-level with `selective_ac_option = "op"` (our `selective`) and every N-th
    block with a number N (our `every_n`), its default "2"."""
    option = str(flat.get("activation_checkpoint.selective_ac_option", "2"))
    if targets.get("parallel.activation_checkpoint") == "selective" and option.isdigit():
        targets.update({"parallel.activation_checkpoint": "every_n",
                        "parallel.activation_checkpoint_every": int(option)})


def _raise(why: str) -> dict[str, Any]:
    raise Unmapped(why)


def _report_to(trackers: list[str]) -> dict[str, Any]:
    if not set(trackers) <= {"tensorboard", "none"}:
        raise Unmapped("clustertrain logs to TensorBoard (metrics.tensorboard) and metrics.jsonl")
    return {"metrics.tensorboard": "tensorboard" in trackers}


# torchtitan's Llama 3 flavors as HF LlamaConfig fields (the published Llama 3.1 sizes)
LLAMA3_FLAVORS = {
    "8B": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32},
    "70B": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64},
    "405B": {"hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128},
}
LLAMA3_COMMON = {"num_key_value_heads": 8, "rope_theta": 500000.0, "max_position_embeddings": 131072,
                 "rms_norm_eps": 1e-5}


# What TrainingArguments do where a key is not given, as far as clustertrain's defaults differ.
HF_DEFAULTS = {"optim.lr": 5e-5, "optim.weight_decay": 0.0, "optim.betas": [0.9, 0.999], "optim.warmup_steps": 0,
               "optim.schedule": "linear", "optim.min_lr_ratio": 0.0, "train.micro_batch_size": 8,
               "train.grad_accum": 1, "train.seed": 42, "checkpoint.every": 500, "metrics.log_every": 500}
