""".venv/bin/python bench/gpu.py

clustertrain's trainer against a hand-written PyTorch loop on issue 12's two GPU workloads, one GPU, side by side.

    .venv/bin/python bench/gpu.py                          # both workloads, eager, 20 steps, median after 10
    .venv/bin/python bench/gpu.py --workload pretrain --compile --steps 30
    .venv/bin/python bench/gpu.py --tiny --steps 3         # the same code with tiny shapes, on CPU, in seconds
    .venv/bin/python bench/gpu.py --set model.kernels=none --workload lora    # vary clustertrain's side

Workloads (bf16 on GPU; fp32 on CPU, where bf16 matmuls are slow and not what is measured):

* pretrain: the Llama-3.2-1B shape (hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, vocab 128256,
  untied), seq 4096, batch 2.
* lora: the Llama-3.2-3B shape (hidden 3072, 28 layers, 24 heads, 8 KV heads, FFN 8192, vocab 128256, tied),
  bf16 base, LoRA r=64 (alpha 128) on every linear layer, seq 1024, batch 4.

Runners, each in its own process (a clean memory peak) with a time limit (--timeout), on random tokens. Both
sides do the same work the same way: one process, so no FSDP or DDP wrapper (clustertrain applies none to one
data-parallel rank, parallel/apply.py), fp32 trainable weights under bf16 autocast, the global gradient norm
clipped to optim.grad_clip, fused AdamW, sdpa attention, and a fresh batch drawn on the host every step and
copied to the GPU. Each prints one `ran:` line saying what it runs as it starts (wrapper, precision, loss,
kernels, compile, clipping, data path).

* clustertrain: `Trainer` on `load_checked_config(None, overrides)` with `data.mode=random` and every other setting at
  its default (loss: chunked for this vocabulary, Liger where installed); `--compile` sets `parallel.compile`.
  tokens/s, MFU and memory are the trainer's own, read back from its metrics.jsonl (`metrics.log_every=1`). The
  run is one step longer than the benchmark, so no final checkpoint is written.
* reference-full: `AutoModelForCausalLM.from_config` with the same HF config (lora: `peft.get_peft_model` on the
  bf16 model, adapters fp32), `F.cross_entropy` on the full fp32 logits [batch, seq, vocab].
* reference-chunked: the same loop with the output layer and loss `train.loss_chunk_tokens` tokens at a time
  (`clustertrain.model.loss.chunked_loss_sum`): what the full logits cost, beside them.
  `--compile` compiles every block and the loss on both reference rows.

Reported per workload: median tokens/s over the steps after --warmup, MFU (`clustertrain.model.estimate`:
6N + 12LHQT FLOPs per token over the device's peak; a CPU's peak is measured), peak memory
(`torch.cuda.max_memory_allocated`, or the process's peak RSS on CPU) and clustertrain / each reference row; then
one line with `clustertrain plan`'s prediction for the clustertrain runner's config (made in this process, on
the CPU: one rank, the h100 or a100 preset by the GPU's name with its memory and datasheet peak, efficiency 0.5;
on a CPU its measured peak) beside what that runner measured: peak memory, step time, tokens/s, plan/measured.
Without a GPU the full shapes refuse to start (exit 2); --tiny runs anywhere.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

RUNNERS = ("clustertrain", "reference-full", "reference-chunked")
RAN = "ran: "  # a child's line that says what it runs; the parent shows these as they come
NO_GPU = ("bench/gpu.py: the full shapes need a GPU and torch sees none; --tiny runs the same code on this CPU in "
          "seconds")


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    model: dict = field(default_factory=dict)  # HF LlamaConfig fields
    vocab_size: int = 128256
    seq_len: int = 1024
    batch: int = 1
    lora_rank: int = 0


WORKLOADS = {
    "pretrain": Workload(
        "pretrain", "pretraining, Llama-3.2-1B shape",
        dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
             intermediate_size=8192, tie_word_embeddings=False),
        seq_len=4096, batch=2,
    ),
    "lora": Workload(
        "lora", "LoRA, Llama-3.2-3B shape",
        dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
             intermediate_size=8192, tie_word_embeddings=True),
        seq_len=1024, batch=4, lora_rank=64,
    ),
}
# --tiny: the same workloads shrunk to seconds on a CPU (tying and LoRA kept).
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)


def shape(workload: Workload, tiny: bool) -> Workload:
    if not tiny:
        return workload
    model = {**workload.model, **TINY}
    return Workload(workload.name, workload.title + " (tiny)", model, vocab_size=512, seq_len=64,
                    batch=workload.batch, lora_rank=min(workload.lora_rank, 8))


def overrides(w: Workload, dtype: str, steps: int, compile: bool, run_dir: str, extra: list[str]) -> list[str]:
    """The clustertrain config of workload `w`; the reference reads its model shape, dtype, optimizer, clipping
    and loss chunk from the same config."""
    model = {**w.model, "max_position_embeddings": w.seq_len}
    return [
        "model.arch=llama",
        "model.config={" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in model.items()) + "}",
        "data.mode=random", f"data.vocab_size={w.vocab_size}", f"data.seq_len={w.seq_len}", "data.num_workers=0",
        f"train.global_batch_size={w.batch}", f"train.micro_batch_size={w.batch}",
        f"train.steps={steps + 1}",  # one more than run: the trainer's final checkpoint never comes
        "train.eval_every=0", "train.sample_tokens=0", "checkpoint.every=0", f"train.run_dir={run_dir}",
        "train.resume=none", "metrics.log_every=1", "metrics.progress=none", "metrics.tensorboard=false",
        f"parallel.param_dtype={dtype}", f"parallel.compile={str(compile).lower()}",
        *([f"lora.rank={w.lora_rank}", f"lora.alpha={2 * w.lora_rank}", "lora.dropout=0"] if w.lora_rank else []),
        *extra,
    ]


# ---- one runner, in its own process ----------------------------------------------------------------------
def precision(model, autocast) -> str:
    """The dtypes a model trains in, in words: the autocast dtype (None: off) and its weights' dtypes."""
    import torch

    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    trainable = {short.get(p.dtype, str(p.dtype)) for p in model.parameters() if p.requires_grad}
    frozen = {short.get(p.dtype, str(p.dtype)) for p in model.parameters() if not p.requires_grad}
    text = f"{short[autocast]} autocast" if autocast is not None else "no autocast"
    text += f", trainable weights {'/'.join(sorted(trainable))}"
    return text + (f", frozen {'/'.join(sorted(frozen))}" if frozen else "")


def say_what_runs(runner: str, **parts: str) -> None:
    print(RAN + runner + ": " + ", ".join(f"{k} {v}" for k, v in parts.items()), flush=True)


def run_clustertrain(cfg, steps: int) -> dict:
    """The trainer's real step path; its metrics.jsonl has tokens/s, MFU and memory for every step."""
    from clustertrain.model.estimate import peak_flops
    from clustertrain.parallel.apply import DTYPES
    from clustertrain.train.metrics import read_metrics
    from clustertrain.train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.build()
        model, p = trainer.model.runner.parts[0], cfg.parallel
        wrapper = trainer.place.mesh.layout.wrapper or "none"
        liger = any("Liger" in getattr(m.forward, "__qualname__", "") for m in model.modules())
        say_what_runs(
            "clustertrain", wrapper=f"{wrapper} ({trainer.place.mesh.dp_size} data-parallel rank)",
            precision=(f"FSDP2 {p.param_dtype} params, {p.reduce_dtype} reduce" if wrapper == "fsdp"
                       else precision(model, getattr(trainer.model.runner, "autocast_dtype", None))),
            loss=trainer.model.loss_kind + (f" ({cfg.train.loss_chunk_tokens} tokens a chunk)"
                                      if trainer.model.loss_kind == "chunked" else ""),
            kernels="liger" if liger else "pytorch", attention=trainer.model.attention,
            compile="blocks and loss" if p.compile else "off",
            clipping=f"global norm {cfg.optim.grad_clip:g}" if cfg.optim.grad_clip else "off",
            optimizer=f"AdamW {'fused' if trainer.optim.optimizer.param_groups[0].get('fused') else 'foreach'}",
            data="the loader's host batch each step, "
                 + ("pinned, non_blocking copy" if getattr(trainer.data.loader, "pin_memory", False) else "on CPU"),
        )
        trainer.start(None)
        trainer.train_steps(steps)
        trainer.logger.close()
        records = [r for r in read_metrics(cfg.run_dir / "metrics.jsonl") if r.get("tokens_per_s") is not None]
        return {
            "tokens_per_s": [r["tokens_per_s"] for r in records],
            "mfu": [r.get("mfu") for r in records],
            "mem_gb": max(r["mem_gb"] for r in records),
            "flops_per_token": trainer.model.flops_per_token,
            "peak_flops": trainer.config.metrics.peak_flops or peak_flops(trainer.place.device,
                                                                          DTYPES[trainer.config.parallel.param_dtype]),
            "device": trainer.place.device.type,
        }
    finally:
        trainer.close()


def run_reference(cfg, steps: int, compile: bool, loss: str) -> dict:
    """HF model (+ peft) under autocast, fused AdamW, clipping, and the full or the chunked loss, timed per step."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from clustertrain.model.estimate import model_flops_per_token, peak_flops
    from clustertrain.model.build import build_hf_config
    from clustertrain.parallel.apply import DTYPES
    from clustertrain.model.loss import chunked_loss_sum
    from clustertrain.train.memory import memory_gb

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # TF32, as clustertrain sets for its fp32 work on a GPU
    dtype = DTYPES[cfg.parallel.param_dtype]
    torch.manual_seed(0)
    hf_config = build_hf_config(cfg.model, None, cfg.data.vocab_size)
    lora = cfg.lora.rank > 0
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa",
                                                 dtype=dtype if lora else torch.float32)
    blocks = [m for m in model.modules() if type(m).__name__ in model._no_split_modules]
    hf_model = model
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=0.0, target_modules="all-linear",
            task_type="CAUSAL_LM",
        ))  # the adapters in fp32 (peft's autocast_adapter_dtype), the base stays in `dtype`
    if compile:
        for block in blocks:
            block.compile()
    autocast = dtype if dtype != torch.float32 else None
    model.train()
    o, chunk = cfg.optim, cfg.train.loss_chunk_tokens
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, fused=True)
    head = hf_model.get_output_embeddings()

    def cross_entropy(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    full = torch.compile(cross_entropy) if compile else cross_entropy
    chunked = torch.compile(chunked_loss_sum, dynamic=False) if compile else chunked_loss_sum

    def loss_fn(ids, labels):
        if loss == "full":
            return full(model(input_ids=ids, use_cache=False).logits, labels)
        # the decoder, then the output layer and the loss a chunk at a time: no [batch, seq, vocab] logits
        hidden = hf_model.model(input_ids=ids, use_cache=False).last_hidden_state
        return chunked(hidden.flatten(0, 1), head.weight, head.bias, labels.flatten(), chunk) / labels.numel()

    say_what_runs(
        f"reference-{loss}", wrapper="none (one process)", precision=precision(model, autocast),
        loss="full (fp32 logits [batch, seq, vocab])" if loss == "full" else f"chunked ({chunk} tokens a chunk)",
        kernels="pytorch", attention="sdpa", compile="blocks and loss" if compile else "off",
        clipping=f"global norm {o.grad_clip:g}" if o.grad_clip else "off", optimizer="AdamW fused",
        data="a fresh host batch each step, " + ("pinned, non_blocking copy" if device.type == "cuda" else "on CPU"),
    )
    generator = torch.Generator().manual_seed(0)
    shape = (cfg.train.global_batch_size, cfg.data.seq_len + 1)
    tokens = cfg.tokens_per_step
    rates = []
    for _ in range(steps):
        start = time.perf_counter()
        batch = torch.randint(hf_config.vocab_size, shape, generator=generator)
        if device.type == "cuda":
            batch = batch.pin_memory().to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext():
            loss_value = loss_fn(batch[:, :-1], batch[:, 1:])
        loss_value.backward()
        if o.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, o.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value.item()  # waits for the GPU, as the trainer's logging does
        rates.append(tokens / (time.perf_counter() - start))
    return {
        "tokens_per_s": rates,
        "mem_gb": memory_gb(device),
        "flops_per_token": model_flops_per_token(model, cfg.data.seq_len),
        "peak_flops": peak_flops(device, dtype),
        "device": device.type,
    }


def run_one(args: argparse.Namespace) -> int:
    """Child process: one runner on one workload; the result goes to --result as JSON."""
    import torch

    from clustertrain.resolve.load import load_checked_config

    w = shape(WORKLOADS[args.workload], args.tiny)
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    with tempfile.TemporaryDirectory(prefix="clustertrain-bench-gpu-") as run_dir:
        cfg = load_checked_config(None, overrides(w, dtype, args.steps, args.compile, run_dir, args.overrides))
        if args.runner == "clustertrain":
            result = run_clustertrain(cfg, args.steps)
        else:
            result = run_reference(cfg, args.steps, args.compile, args.runner.removeprefix("reference-"))
    result["dtype"] = dtype
    if torch.cuda.is_available():  # for the plan, which the parent makes without touching the GPU
        result["device_name"] = torch.cuda.get_device_name(0)
        result["device_memory_gb"] = torch.cuda.get_device_properties(0).total_memory / 1e9
    Path(args.result).write_text(json.dumps(result))
    return 0


# ---- the side-by-side table -----------------------------------------------------------------------------
def summarize(result: dict, warmup: int, peak_flops: float | None) -> dict:
    """Medians after warmup. MFU: clustertrain's as it logged it; otherwise from FLOPs/token over `peak_flops`
    (clustertrain's peak, so that a CPU's measured peak is the same for every row)."""
    tokens_per_s = statistics.median(result["tokens_per_s"][warmup:])
    mfus = [m for m in result.get("mfu", [])[warmup:] if m is not None]
    if mfus:
        mfu = statistics.median(mfus)
    else:
        peak = peak_flops or result["peak_flops"]
        mfu = result["flops_per_token"] * tokens_per_s / peak if peak else None
    return {"tokens_per_s": tokens_per_s, "mfu": mfu, "mem_gb": result["mem_gb"]}


def child(args: argparse.Namespace, workload: str, runner: str, result: Path) -> tuple[dict | None, str]:
    """Run one runner in a process of its own session, showing its `ran:` line as it comes; past --timeout
    seconds the process and everything it started are killed."""
    argv = [sys.executable, __file__, "--runner", runner, "--workload", workload, "--steps", str(args.steps),
            "--result", str(result), *(["--tiny"] if args.tiny else []), *(["--compile"] if args.compile else []),
            *(f"--set={o}" for o in args.overrides)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=60)

    def relay() -> None:
        for line in proc.stdout:
            tail.append(line)
            if line.startswith(RAN):
                print("  " + line.removeprefix(RAN), end="", flush=True)

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # the runner, past its time or interrupted, and whatever it left behind (compile workers)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    reader.join(timeout=10)
    output = "".join(tail)[-3000:]
    if timed_out:
        return None, f"{runner} ran past --timeout {args.timeout:g} s and was killed:\n{output}"
    if proc.returncode != 0 or not result.exists():
        return None, f"{runner} exited {proc.returncode}:\n{output}"
    return json.loads(result.read_text()), ""


def print_table(w: Workload, rows: dict[str, dict | None], device: str, dtype: str, args: argparse.Namespace) -> None:
    lora = f", LoRA r={w.lora_rank} on all linear layers" if w.lora_rank else ""
    print(f"\n{w.title}: seq {w.seq_len} x batch {w.batch}{lora}, {dtype} on {device}, "
          f"{'compiled' if args.compile else 'eager'}, median of steps {args.warmup + 1}-{args.steps}")
    header = f"{'runner':<19}{'tokens/s':>12}{'MFU':>9}{'peak mem':>12}"
    print(header)
    print("-" * len(header))
    for runner, row in rows.items():
        if row is None:
            print(f"{runner:<19}{'failed':>12}")
            continue
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "-"
        print(f"{runner:<19}{row['tokens_per_s']:>12,.0f}{mfu:>9}{row['mem_gb']:>9.2f} GB")
    ct = rows.get("clustertrain")
    for name in RUNNERS[1:]:
        ref = rows.get(name)
        if ct and ref:
            print(f"ratio clustertrain/{name}: tokens/s {ct['tokens_per_s'] / ref['tokens_per_s']:.2f}, "
                  f"peak memory {ct['mem_gb'] / ref['mem_gb']:.2f}")
    sys.stdout.flush()


# ---- the plan beside the measurement ----------------------------------------------------------------------
def gpu_of(results: list[dict]) -> dict | None:
    """The GPU the runners ran on ({"name", "memory_gb"}), None on the CPU. From a runner's result, so that this
    process never starts CUDA (a context here would hold GPU memory through the next runners); asked here only
    when no runner came back."""
    import torch

    if not torch.cuda.is_available():
        return None
    for result in results:
        if "device_name" in result:
            return {"name": result["device_name"], "memory_gb": result["device_memory_gb"]}
    return {"name": torch.cuda.get_device_name(0), "memory_gb": torch.cuda.get_device_properties(0).total_memory / 1e9}


def make_workload_plan(w: Workload, gpu: dict | None, args: argparse.Namespace):
    """`clustertrain plan` of the config the clustertrain runner trains, for one rank: on a GPU, its memory and
    datasheet peak (the hardware catalogue); on the CPU, this CPU's measured peak. Made in this process, which has
    no process group (the plan makes a fake one)."""
    import torch

    from clustertrain.model.estimate import peak_flops_for_name
    from clustertrain.plan.plan import make_plan
    from clustertrain.plan.target import TargetRequest, target_for
    from clustertrain.resolve.load import load_checked_config
    from clustertrain.resolve.run import resolve

    dtype = "bfloat16" if gpu else "float32"  # as run_one
    memory_gb = tflops = None
    if gpu:
        memory_gb = gpu["memory_gb"]
        peak = peak_flops_for_name(gpu["name"], torch.bfloat16)
        tflops = peak / 1e12 if peak else None
    with tempfile.TemporaryDirectory(prefix="clustertrain-bench-gpu-") as run_dir, \
            contextlib.redirect_stdout(sys.stderr):  # whatever it says stays out of the tables
        config = load_checked_config(None, overrides(w, dtype, args.steps, args.compile, run_dir, args.overrides))
        target = target_for(config, TargetRequest(world=1, ranks_per_node=1, device_memory_gb=memory_gb,
                                                  peak_tflops=tflops, efficiency=0.5))
        run = resolve(target.config, target.world, target.device.per_node, "cuda" if gpu else "cpu")
        return make_plan(run.config, run.layout, target.device.per_node, target.device)


def _figure(x: float) -> str:
    return f"{x:,.2f}" if x >= 1 else f"{x:.3g}"


def _versus(planned: float | None, measured: float | None, unit: str) -> str:
    text = (f"{_figure(planned)}{unit}" if planned is not None else "?") + " vs " + \
        (f"{_figure(measured)}{unit}" if measured is not None else "?")
    return text + (f" ({planned / measured:.2f})" if planned is not None and measured else "")


def plan_line(plan, row: dict | None, w: Workload, gpu: dict | None) -> str:
    """The plan's peak memory, step time and tokens/s beside the clustertrain runner's; the ratios plan/measured."""
    measured_mem = row["mem_gb"] if row else None
    measured_tps = row["tokens_per_s"] if row else None
    measured_step = w.batch * w.seq_len / measured_tps if measured_tps else None
    tps = (f"{plan.tokens_per_s:,.0f}" if plan.tokens_per_s else "?") + " vs " + \
        (f"{measured_tps:,.0f}" if measured_tps else "?")
    line = (f"plan vs measured (clustertrain): peak memory {_versus(plan.peak_bytes / 1e9, measured_mem, ' GB')}, "
            f"step time {_versus(plan.step_s, measured_step, ' s')}, tokens/s {tps}")
    if gpu is None:
        line += " (CPU: measured is the process's peak RSS, which includes ~0.5 GB of libraries)"
    return line


def print_plan(w: Workload, rows: dict[str, dict | None], results: list[dict], args: argparse.Namespace) -> None:
    """One line after the workload's table; a plan that fails says so in one line and changes nothing else."""
    try:
        gpu = gpu_of(results)
        line = plan_line(make_workload_plan(w, gpu, args), rows.get("clustertrain"), w, gpu)
    except Exception as error:  # noqa: BLE001 - the benchmark's result does not depend on the plan
        line = " ".join(f"plan failed: {type(error).__name__}: {error}".split())  # one line
        line = line if len(line) <= 300 else line[:299] + "…"
    print(line, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="clustertrain against a hand-written HF + PyTorch loop on one GPU")
    p.add_argument("--workload", choices=["pretrain", "lora", "both"], default="both")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per runner (default 20)")
    p.add_argument("--warmup", type=int, default=None,
                   help="steps left out of the median (default: half of --steps, at most 10)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: the same code on CPU in seconds")
    p.add_argument("--compile", action="store_true", help="compile every runner (blocks and loss)")
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds each runner's process may take before it is killed (default 900)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a clustertrain config override (repeatable), e.g. model.kernels=none")
    p.add_argument("--runner", choices=RUNNERS, help=argparse.SUPPRESS)  # internal: run one side in this process
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup is None:
        args.warmup = min(10, args.steps // 2)
    if args.steps < 1 or not 0 <= args.warmup < args.steps or args.timeout <= 0:
        p.error("need --steps >= 1, 0 <= --warmup < --steps and --timeout > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.tiny:
        import torch

        if not torch.cuda.is_available():
            print(NO_GPU, file=sys.stderr)
            return 2
    if args.runner:
        if args.workload == "both":
            raise SystemExit("--runner needs one --workload")
        return run_one(args)
    names = ["pretrain", "lora"] if args.workload == "both" else [args.workload]
    failed = False
    with tempfile.TemporaryDirectory(prefix="clustertrain-bench-gpu-") as tmp:
        for name in names:
            rows, device, dtype, peak, results = {}, "?", "?", None, []
            for runner in RUNNERS:
                print(f"{name}: running {runner} ...", flush=True)
                result, error = child(args, name, runner, Path(tmp) / f"{name}-{runner}.json")
                if result is None:
                    print(error, file=sys.stderr, flush=True)
                    failed = True
                    rows[runner] = None
                    continue
                results.append(result)
                device, dtype = result["device"], result["dtype"]
                peak = peak or result["peak_flops"]
                rows[runner] = summarize(result, args.warmup, peak)
            w = shape(WORKLOADS[name], args.tiny)
            print_table(w, rows, device, dtype, args)
            print_plan(w, rows, results, args)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
