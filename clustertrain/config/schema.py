"""The run config: one typed schema, one section per component.

Each component receives only its own section. Field descriptions double as the config reference
(`docs/config.md` is generated from them). The larger sections have their own modules (data_schema.py,
metrics_schema.py, slurm_schema.py); RunConfig here joins them and checks the rules across sections. What is
installed is not the schema's concern (clustertrain.resolve.packages).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from clustertrain.config.data_schema import DataConfig
from clustertrain.config.metrics_schema import MetricsConfig
from clustertrain.config.section import ConfigPath, Section
from clustertrain.config.slurm_schema import SLURM_TIME_FORMS, SlurmConfig, Walltime, walltime_seconds
from clustertrain.config.strategy import Strategy, read_stage_keys


class ModelConfig(Section):
    arch: str = Field("llama", description="HF model type to build from scratch (llama, gpt2, opt, qwen2, mistral, ...).")
    config: dict[str, Any] = Field(
        default_factory=lambda: {
            "hidden_size": 128,
            "intermediate_size": 344,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "max_position_embeddings": 1024,
        },
        description="HF config fields for `arch`, e.g. hidden_size; vocab_size comes from the tokenizer.",
    )
    attn_implementation: Literal["auto", "sdpa", "flash_attention_2", "flex_attention", "eager"] = Field(
        "auto", description="Attention kernel: sdpa (torch's flash and memory-efficient kernels on GPU), "
        "flash_attention_2 (needs the flash-attn package), flex_attention (document masks without a dense mask), "
        "eager. auto: sdpa, except document-masked or SFT runs on GPU, which take flash_attention_2 when flash-attn "
        "is installed, else flex_attention.",
    )
    kernels: Literal["auto", "liger", "none"] = Field(
        "auto", description="Fused kernels: liger (liger-kernel's RMSNorm, RoPE, SwiGLU and fused linear cross "
        "entropy; CUDA only, for the families it supports), none (plain PyTorch). auto: liger when it is installed "
        "and can run, else none.",
    )
    path: ConfigPath | None = Field(
        None, description="A local HF model directory (config.json, safetensors or .bin weights, tokenizer) to "
        "fine-tune. Its config replaces model.arch and model.config; model.config keys you set override it."
    )
    hub_id: str | None = Field(
        None, description="A Hugging Face model id, found in the local HF cache with no network (fetch it first "
        "with `clustertrain download`)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if self.path and self.hub_id:
            raise ValueError("give model.path or model.hub_id, not both")
        return self

    @property
    def pretrained(self) -> bool:
        """Whether weights come from a snapshot rather than a fresh initialization."""
        return bool(self.path or self.hub_id)

    @property
    def config_fields(self) -> dict[str, Any]:
        """The model.config fields a run builds with: for a snapshot only those set, as its config has the rest
        (the defaults describe the model built from scratch). A config.json's model_type is model.arch's."""
        fields = self.config if not self.pretrained or "config" in self.model_fields_set else {}
        return {key: value for key, value in fields.items() if key != "model_type"}


class LoraConfig(Section):
    rank: int = Field(0, ge=0, description="LoRA rank r; 0 trains every weight (full fine-tuning).")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha: the adapter's update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names to adapt (e.g. [q_proj, v_proj]), or all-linear: every linear "
        "layer except the output head."
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class ParallelConfig(Section):
    strategy: Strategy = Field(
        "ddp",
        description="Data parallelism: DDP, FSDP2 grad-op shard (zero2), FSDP2 full shard (zero3), or their hybrid "
        "forms (replicate across groups, shard within). auto: the layout (strategy, tp, micro batch, activation "
        "checkpointing) that `clustertrain plan --search` ranks fastest among those that fit, chosen again at "
        "every start (a requeue on another node count re-plans). Also read: the training stub's zero3_hybrid, "
        "zero2_hybrid, and keys `sharding_stage: 0|2|3` with `zero3_hybrid: true|false` (config/strategy.py).",
    )
    hybrid_shard_size: int | None = Field(
        None, gt=0, description="Ranks per shard group for hybrid strategies; default: the ranks of one node."
    )
    _stage_keys = model_validator(mode="before")(classmethod(lambda cls, data: read_stage_keys(data)))
    tp: int = Field(1, gt=0, description="Tensor-parallel degree: each block's linears split over this many ranks "
                    "(the model's own `base_model_tp_plan`).")
    sequence_parallel: Literal["auto"] | bool = Field(
        "auto", description="With tp > 1, also split the sequence between the split linears (torchtitan's sequence "
        "parallelism): the residual stream, norms and dropout of each tp rank hold 1/tp of the tokens. auto: on when "
        "tp > 1 divides data.seq_len and the model's family declares its norms; true requires both.",
    )
    pp: int = Field(1, gt=0, description="Pipeline-parallel degree: the decoder layers split over this many ranks, "
                    "one stage per rank (pp_stages_per_rank under interleaved_1f1b).")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field(
        "1f1b", description="Pipeline schedule (with pp > 1): all forwards then all backwards (gpipe), or one forward "
        "one backward (1f1b, less activation memory), or 1f1b over several stages per rank (interleaved_1f1b, a "
        "smaller pipeline bubble).",
    )
    pp_stages_per_rank: int = Field(
        2, gt=0,
        description="Stages per rank under interleaved_1f1b (stage s on rank s % pp); other schedules run one.",
    )
    microbatches: int | None = Field(
        None, gt=0, description="Microbatches per step with pp > 1: each rank's share of the global batch is split into "
        "this many (must divide it); default: train.grad_accum when given, else pp. Replaces train.micro_batch_size "
        "under pipeline parallelism.",
    )
    dp_shard: int | None = Field(
        None, gt=0, description="Ranks that shard parameters (FSDP); default from `strategy`. "
        "pp × dp_replicate × dp_shard × tp is the world size.",
    )
    dp_replicate: int | None = Field(
        None, gt=0, description="Ranks that hold replicas (DDP, or across hybrid shard groups); default from `strategy`."
    )
    param_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Compute dtype. auto: bfloat16 on a GPU that supports it (Ampere, Hopper, MI200 and "
        "newer), else float32 (on CUDA with TF32 matmuls). The run's config.yaml records what ran.",
    )
    loss_scale: float = Field(2.0**16, gt=0, allow_inf_nan=False, description="float16: the loss scaler's first "
                              "scale; it halves at every step whose scaled gradients overflow (that step is skipped).")
    activation_checkpoint: Literal["none", "full", "selective", "every_n"] = Field(
        "none", description="Recompute block activations in backward instead of keeping them: all of every block "
        "(full), all but the outputs of its matmuls (every other one) and attention in every block (selective, "
        "torchtitan's op-level mode), all of every `activation_checkpoint_every`-th block (every_n), or none.",
    )
    activation_checkpoint_every: int = Field(2, gt=0, description="every_n checkpointing's stride in blocks.")
    compile: bool = Field(False, description="torch.compile each transformer block (after tp and checkpointing, "
                          "before sharding).")
    reduce_dtype: Literal["float32", "bfloat16"] = Field("float32", description="Gradient reduction dtype.")
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: nccl (RCCL on ROCm) on GPUs, gloo on CPU.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available, else cpu.")
    timeout_minutes: float = Field(10, gt=0, description="Collective timeout before a hung rank fails the run; also how "
                                   "long the other ranks wait for a rank 0 that gives no sign of life while it "
                                   "prepares the tokenizer or indexes the data.")


Beta = Annotated[float, Field(ge=0, lt=1)]


class OptimConfig(Section):
    lr: float = Field(3e-3, gt=0, allow_inf_nan=False, description="Peak learning rate.")
    implementation: Literal["auto", "fused", "foreach"] = Field(
        "auto", description="AdamW kernel: fused (one kernel per step; CUDA, ROCm, and CPU in recent torch), foreach "
        "(batched tensor ops). auto: fused where the installed torch supports it for the device and parameters.",
    )
    weight_decay: float = Field(0.1, ge=0, allow_inf_nan=False,
                                description="AdamW decay of matrices (norms and biases never decay).")
    betas: tuple[Beta, Beta] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1).")
    eps: float = Field(1e-8, gt=0, allow_inf_nan=False, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this; 0 disables clipping.")
    warmup_steps: int = Field(20, ge=0, description="Steps of linear warmup from 0 to optim.lr.")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warmup.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final lr as a fraction of the peak (cosine, linear).")


class TrainConfig(Section):
    run_dir: ConfigPath | None = Field(None, description="Run directory; default runs/<config name>.")
    steps: int | None = Field(300, gt=0, description="Optimizer steps; or set `tokens`.")
    tokens: int | None = Field(None, gt=0, description="Token budget; overrides `steps` when set.")
    epochs: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="Passes over the training data; overrides `steps` when set. One "
        "epoch is the fewest sequences any row of the global batch gets from one pass over its documents (every source "
        "once), counted by tokenizing the training data at start: for data sets that fit a fine-tuning run.",
    )
    global_batch_size: int = Field(16, gt=0, description="Sequences per optimizer step, whatever the rank count.")
    micro_batch_size: int = Field(
        8, gt=0, description="Sequences per forward/backward on one rank, at most; capped at a rank's share of "
        "global_batch_size (the start line says so), so that a run resumes on more ranks.",
    )
    grad_accum: int | None = Field(
        None, gt=0, description="Instead of global_batch_size, the HF/DeepSpeed way: micro-batches per rank per step, so "
        "global_batch_size = micro_batch_size x grad_accum x data-parallel ranks, which fits any node count (a resume "
        "needs the same global batch, so the same rank count).",
    )
    seed: int = Field(1234, ge=0, lt=2**63, description="Seeds the initial weights and the data order (same on any "
                      "rank count); 0 to 2^63-1.")
    resume: ConfigPath = Field("auto", description="auto: newest checkpoint of the run if any; none: start fresh; or a path.")
    overwrite: bool = Field(
        False, description="With resume none, start over in a run directory that has checkpoints (moved aside)."
    )
    stop_after_steps: int | None = Field(
        None, gt=0, description="End this run after this many steps (with a checkpoint); the schedule is unchanged."
    )
    walltime: Walltime = Field(
        None, description="This job's time limit: save and exit for requeue walltime_margin before it. A number is "
        f"seconds; text is a Slurm time, as sbatch --time takes it ({SLURM_TIME_FORMS}; a bare \"90\" is 90 minutes)."
    )
    walltime_margin: float = Field(300, ge=0, description="Seconds before train.walltime to save and stop.")
    on_nan: Literal["stop", "skip"] = Field(
        "stop", description="A step whose loss or gradient norm is NaN or inf: stop (fail the run, exit 3, before "
        "any checkpoint of the bad state is written) or skip (no update on any rank, counted as nan_skipped; the run "
        "stops after 10 in a row). float16 runs skip overflowed steps through their loss scaler either way.",
    )

    @model_validator(mode="after")
    def _batch_fits(self) -> TrainConfig:
        if self.epochs is not None and self.tokens is not None:
            raise ValueError("set train.tokens or train.epochs, not both")
        if self.grad_accum is not None and "global_batch_size" in self.model_fields_set:
            raise ValueError("set train.global_batch_size or train.grad_accum (with micro_batch_size), not both")
        if self.grad_accum is None and "micro_batch_size" in self.model_fields_set and \
                self.micro_batch_size > self.global_batch_size:
            raise ValueError(f"micro_batch_size = {self.micro_batch_size} is larger than global_batch_size = "
                             f"{self.global_batch_size}, the most any rank can get per step")
        return self
    eval_every: int = Field(100, ge=0, description="Evaluate every N steps and at the end; 0 disables.")
    eval_batches: int = Field(4, gt=0, description="Global batches per evaluation.")
    eval_tasks: list[str] = Field([], description="lm-eval tasks scored at each evaluation (eval_<task>_<metric>), "
                                  "as `clustertrain eval --tasks` takes them; the `eval` extra. See docs/generate-eval.md.")
    eval_tasks_limit: int | None = Field(200, gt=0, description="Documents per task at each evaluation; null: all.")
    sample_tokens: int = Field(40, ge=0, description="Tokens of the sample generated at the end; 0 disables.")
    sample_prompt: str | None = Field(
        None, description="The prompt of the end-of-run sample; default: from the run's data: the prompt of the first "
        "SFT example, or the first 16 tokens of the first document, held-out data first.",
    )
    loss: Literal["auto", "chunked", "full"] = Field(
        "auto", description="How the output layer and cross entropy run: chunked (a slice of tokens at a time, never "
        "the whole batch's full-vocabulary fp32 logits), full (the model's logits, then the loss). auto: chunked when "
        "the vocabulary has at least 32,768 tokens.",
    )
    loss_chunk_tokens: int = Field(4096, gt=0, description="Tokens per slice of the chunked loss.")


class CheckpointConfig(Section):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    every: int = Field(100, ge=0, description="Save every N steps (0: only at the end).")
    keep_last: int | None = Field(3, gt=0, description="Keep the newest K checkpoints (empty: keep all).")
    keep_every: int | None = Field(None, gt=0, description="Also keep every checkpoint whose step is a multiple of M.")
    async_save: bool | Literal["auto"] = Field(
        "auto", alias="async", description="Write checkpoints in the background while training goes on (key: async); "
        "auto: on GPUs (staged through pinned host memory), not on CPU. The final save of a run always completes "
        "before the run ends."
    )
    on_error: Literal["warn", "stop"] = Field(
        "warn", description="A failed write (disk full, permissions): warn and train on, or stop (exit 74). The "
        "previous checkpoint is kept either way, and a run's last save must succeed either way: if it fails, the run "
        "fails (exit 74)."
    )


class WatchdogConfig(Section):
    """The hang watchdog (distributed/watchdog.py): a rank stuck in one phase past its timeout ends the job with
    exit 76, its stacks in <run_dir>/hang/, and the Slurm path requeues it."""

    enabled: bool = Field(True, description="Beat a heartbeat per rank and end a hung run (exit 76) with a report.")
    heartbeat_s: float = Field(10, gt=0, allow_inf_nan=False,
                               description="Seconds between a rank's heartbeats in <run_dir>/heartbeats/.")
    startup_timeout_s: float = Field(3600, gt=0, description="Building the model and loading the checkpoint "
                                     "(not the tokenizer and data preparation, which rank 0 reports on itself).")
    first_step_timeout_s: float = Field(1800, gt=0, description="The first step of a start (compilation, warm-up).")
    step_timeout_s: float = Field(300, gt=0, description="A step may take this long, or step_timeout_factor times the "
                                  "median step if that is longer; below parallel.timeout_minutes, which would end a "
                                  "hung collective first, without a report.")
    step_timeout_factor: float = Field(10, ge=1, description="A step past this many median steps is hung.")
    save_timeout_s: float = Field(1800, gt=0, description="A checkpoint save (and the end of the run).")
    eval_timeout_s: float = Field(1800, gt=0, description="An evaluation or the end-of-run sample.")


class RunConfig(Section):
    name: str = Field("default", description="Run name; the config file's stem unless set.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)

    @model_validator(mode="after")
    def _eval_tasks_runnable(self) -> RunConfig:
        if self.train.eval_tasks and self.parallel.pp > 1:
            raise ValueError("train.eval_tasks cannot run under parallel.pp > 1 (no stage holds the whole forward); "
                             "evaluate the checkpoints with `clustertrain eval RUN_DIR --tasks ...`")
        return self

    @model_validator(mode="after")
    def _watchdog_first(self) -> RunConfig:
        collective_s = self.parallel.timeout_minutes * 60
        if self.watchdog.enabled and self.watchdog.step_timeout_s >= collective_s:
            raise ValueError(f"watchdog.step_timeout_s = {self.watchdog.step_timeout_s:g} must be below "
                             f"parallel.timeout_minutes = {self.parallel.timeout_minutes:g} ({collective_s:g} s): a hung "
                             "collective would end the run first, without naming the stuck rank")
        return self

    def updated(self, **changes: Any) -> RunConfig:
        """A copy with `changes`: a section's fields as a dict (`train={"steps": 3}`) or a top-level value
        (`name="x"`). Configs are frozen; this is how a config is derived from another (unvalidated: for values
        the package computes, not for user input)."""
        update = {key: getattr(self, key).model_copy(update=value) if isinstance(getattr(self, key), Section) else value
                  for key, value in changes.items()}
        return self.model_copy(update=update)

    @property
    def walltime_s(self) -> float | None:
        """train.walltime in seconds."""
        return walltime_seconds(self.train.walltime)

    @property
    def run_dir(self) -> Path:
        return Path(self.train.run_dir or f"runs/{self.name}")

    @property
    def tokens_per_step(self) -> int:
        """The tokens of one optimizer step: train.global_batch_size rows of data.seq_len."""
        return self.train.global_batch_size * self.data.seq_len

    @property
    def data_seed(self) -> int:
        """data.seed, or train.seed where it is unset."""
        return self.data.seed if self.data.seed is not None else self.train.seed
