""".venv/bin/python bench/gpu.py

clustertrain's trainer against a hand-written PyTorch loop on issue 12's two GPU workloads, one GPU, side by side.

    .venv/bin/python bench/gpu.py                          # both workloads, eager, 20 steps, median after 10
    .venv/bin/python bench/gpu.py --workload pretrain --compile --steps 30
    .venv/bin/python bench/gpu.py --tiny --steps 3         # the same code with tiny shapes, on CPU, in seconds
    .venv/bin/python bench/gpu.py --set parallel.strategy=ddp --workload lora   # vary clustertrain's side

Workloads (bf16 on GPU; fp32 on CPU, where bf16 matmuls are slow and not what is measured):

* pretrain: the Llama-3.2-1B shape (hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, vocab 128256,
  untied), seq 4096, batch 2.
* lora: the Llama-3.2-3B shape (hidden 3072, 28 layers, 24 heads, 8 KV heads, FFN 8192, vocab 128256, tied),
  bf16 base, LoRA r=64 (alpha 128) on every linear layer, seq 1024, batch 4.

Runners, each in its own process (a clean process group and a clean memory peak), on random tokens:

* clustertrain: `Trainer` on `load_config(None, overrides)` with `data.mode=random`, `parallel.strategy=zero3`
  (FSDP2, bf16 params, fp32 reduce), its default loss, optimizer and kernels; `--compile` sets
  `parallel.compile`. tokens/s, MFU and memory are the trainer's own, read back from its metrics.jsonl
  (`metrics.log_every=1`). The run is one step longer than the benchmark, so no final checkpoint is written.
* reference: `AutoModelForCausalLM.from_config` with the same HF config, fused `torch.optim.AdamW`, plain
  `F.cross_entropy` on fp32 logits. pretrain: FSDP2 `fully_shard` per block and root with
  `MixedPrecisionPolicy(bf16 params, fp32 reduce)`, fp32 master weights. lora: `peft.get_peft_model` on a bf16
  model (adapters fp32) under `torch.autocast(bf16)`, no FSDP, as HF Trainer + peft runs on one GPU.
  `--compile` compiles every block and the loss.

Reported per workload: median tokens/s over the steps after --warmup, MFU (`clustertrain.model.estimate`:
6N + 12LHQT FLOPs per token over the device's peak; a CPU's peak is measured), peak memory
(`torch.cuda.max_memory_allocated`, or the process's peak RSS on CPU) and clustertrain / reference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

RUNNERS = ("clustertrain", "reference")


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
    """The clustertrain config of workload `w`; the reference reads its model shape from the same config."""
    model = {**w.model, "max_position_embeddings": w.seq_len}
    return [
        "model.arch=llama",
        "model.config={" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in model.items()) + "}",
        "data.mode=random", f"data.vocab_size={w.vocab_size}", f"data.seq_len={w.seq_len}", "data.num_workers=0",
        f"train.global_batch_size={w.batch}", f"train.micro_batch_size={w.batch}",
        f"train.steps={steps + 1}",  # one more than run: the trainer's final checkpoint never comes
        "train.eval_every=0", "train.sample_tokens=0", "checkpoint.every=0", f"train.run_dir={run_dir}",
        "train.resume=none", "metrics.log_every=1", "metrics.progress=none", "metrics.tensorboard=false",
        "parallel.strategy=zero3", f"parallel.param_dtype={dtype}", "parallel.reduce_dtype=float32",
        f"parallel.compile={str(compile).lower()}",
        *([f"lora.rank={w.lora_rank}", f"lora.alpha={2 * w.lora_rank}", "lora.dropout=0"] if w.lora_rank else []),
        *extra,
    ]


# ---- one runner, in its own process ----------------------------------------------------------------------
def run_clustertrain(cfg, steps: int) -> dict:
    """The trainer's real step path; its metrics.jsonl has tokens/s, MFU and memory for every step."""
    from clustertrain.train.metrics import read_jsonl
    from clustertrain.train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.build()
        trainer.start(None)
        trainer.train_steps(steps)
        trainer.logger.close()
        records = [r for r in read_jsonl(cfg.run_dir / "metrics.jsonl") if r.get("tokens_per_s") is not None]
        return {
            "tokens_per_s": [r["tokens_per_s"] for r in records],
            "mfu": [r.get("mfu") for r in records],
            "mem_gb": max(r["mem_gb"] for r in records),
            "flops_per_token": trainer.flops_per_token,
            "peak_flops": trainer.peak_flops,
            "device": trainer.device.type,
        }
    finally:
        trainer.close()


def run_reference(cfg, steps: int, compile: bool) -> dict:
    """HF model + (FSDP2 | peft) + fused AdamW + plain cross entropy, timed step by step."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    from clustertrain.model.estimate import model_flops_per_token, peak_flops
    from clustertrain.model.load import build_hf_config
    from clustertrain.parallel.apply import DTYPES
    from clustertrain.train.trainer import memory_gb

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = DTYPES[cfg.parallel.param_dtype]
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if backend == "nccl" else None)
    try:
        torch.manual_seed(0)
        hf_config = build_hf_config(cfg.model, None, cfg.data.vocab_size)
        lora = cfg.lora.rank > 0
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                hf_config, attn_implementation="sdpa", dtype=dtype if lora else torch.float32
            )
        blocks = [m for m in model.modules() if type(m).__name__ in model._no_split_modules]
        if lora:
            import peft

            model = peft.get_peft_model(model, peft.LoraConfig(
                r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=0.0, target_modules="all-linear",
                task_type="CAUSAL_LM",
            ))  # the adapters in fp32 (peft's autocast_adapter_dtype), the base stays in `dtype`
        if compile:
            for block in blocks:
                block.compile()
        autocast = lora and dtype != torch.float32
        if not lora:
            policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
            for block in blocks:
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
        model.train()
        o = cfg.optim
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=o.lr, betas=o.betas,
                                      eps=o.eps, weight_decay=o.weight_decay, fused=True)

        def cross_entropy(logits, labels):
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

        loss_fn = torch.compile(cross_entropy) if compile else cross_entropy
        shape = (cfg.train.global_batch_size, cfg.data.seq_len + 1)
        pool = [torch.randint(hf_config.vocab_size, shape, device=device) for _ in range(4)]
        tokens = cfg.train.global_batch_size * cfg.data.seq_len
        rates = []
        for step in range(steps):
            batch = pool[step % len(pool)]
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=dtype, enabled=autocast):
                logits = model(input_ids=batch[:, :-1], use_cache=False).logits
                loss = loss_fn(logits, batch[:, 1:])
            del logits
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()  # waits for the GPU, as the trainer's logging does
            rates.append(tokens / (time.perf_counter() - start))
        return {
            "tokens_per_s": rates,
            "mem_gb": memory_gb(device),
            "flops_per_token": model_flops_per_token(model, cfg.data.seq_len),
            "peak_flops": peak_flops(device, dtype),
            "device": device.type,
        }
    finally:
        dist.destroy_process_group()


def run_one(args: argparse.Namespace) -> int:
    """Child process: one runner on one workload; the result goes to --result as JSON."""
    import torch

    from clustertrain.config.load import load_config

    w = shape(WORKLOADS[args.workload], args.tiny)
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    with tempfile.TemporaryDirectory(prefix="clustertrain-bench-gpu-") as run_dir:
        cfg = load_config(None, overrides(w, dtype, args.steps, args.compile, run_dir, args.overrides))
        if args.runner == "clustertrain":
            result = run_clustertrain(cfg, args.steps)
        else:
            result = run_reference(cfg, args.steps, args.compile)
    result["dtype"] = dtype
    Path(args.result).write_text(json.dumps(result))
    return 0


# ---- the side-by-side table -----------------------------------------------------------------------------
def summarize(result: dict, warmup: int, peak_flops: float | None) -> dict:
    """Medians after warmup. MFU: clustertrain's as it logged it; otherwise from FLOPs/token over `peak_flops`
    (clustertrain's peak, so that a CPU's measured peak is the same for both rows)."""
    tokens_per_s = statistics.median(result["tokens_per_s"][warmup:])
    mfus = [m for m in result.get("mfu", [])[warmup:] if m is not None]
    if mfus:
        mfu = statistics.median(mfus)
    else:
        peak = peak_flops or result["peak_flops"]
        mfu = result["flops_per_token"] * tokens_per_s / peak if peak else None
    return {"tokens_per_s": tokens_per_s, "mfu": mfu, "mem_gb": result["mem_gb"]}


def child(args: argparse.Namespace, workload: str, runner: str, result: Path) -> tuple[dict | None, str]:
    argv = [sys.executable, __file__, "--runner", runner, "--workload", workload, "--steps", str(args.steps),
            "--result", str(result), *(["--tiny"] if args.tiny else []), *(["--compile"] if args.compile else []),
            *(f"--set={o}" for o in args.overrides)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0 or not result.exists():
        return None, f"{runner} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
    return json.loads(result.read_text()), ""


def print_table(w: Workload, rows: dict[str, dict | None], device: str, dtype: str, args: argparse.Namespace) -> None:
    lora = f", LoRA r={w.lora_rank} on all linear layers" if w.lora_rank else ""
    print(f"\n{w.title}: seq {w.seq_len} x batch {w.batch}{lora}, {dtype} on {device}, "
          f"{'compiled' if args.compile else 'eager'}, median of steps {args.warmup + 1}-{args.steps}")
    header = f"{'runner':<14}{'tokens/s':>12}{'MFU':>9}{'peak mem':>12}"
    print(header)
    print("-" * len(header))
    for runner, row in rows.items():
        if row is None:
            print(f"{runner:<14}{'failed':>12}")
            continue
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "-"
        print(f"{runner:<14}{row['tokens_per_s']:>12,.0f}{mfu:>9}{row['mem_gb']:>9.2f} GB")
    ct, ref = rows.get("clustertrain"), rows.get("reference")
    if ct and ref:
        print(f"ratio clustertrain/reference: tokens/s {ct['tokens_per_s'] / ref['tokens_per_s']:.2f}, "
              f"peak memory {ct['mem_gb'] / ref['mem_gb']:.2f}")
    sys.stdout.flush()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="clustertrain against a hand-written HF + FSDP2 loop on one GPU")
    p.add_argument("--workload", choices=["pretrain", "lora", "both"], default="both")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per runner (default 20)")
    p.add_argument("--warmup", type=int, default=None,
                   help="steps left out of the median (default: half of --steps, at most 10)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: the same code on CPU in seconds")
    p.add_argument("--compile", action="store_true", help="compile both runners (blocks and loss)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a clustertrain config override (repeatable), e.g. parallel.strategy=ddp")
    p.add_argument("--runner", choices=RUNNERS, help=argparse.SUPPRESS)  # internal: run one side in this process
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup is None:
        args.warmup = min(10, args.steps // 2)
    if args.steps < 1 or not 0 <= args.warmup < args.steps:
        p.error("need --steps >= 1 and 0 <= --warmup < --steps")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.runner:
        if args.workload == "both":
            raise SystemExit("--runner needs one --workload")
        return run_one(args)
    names = ["pretrain", "lora"] if args.workload == "both" else [args.workload]
    failed = False
    with tempfile.TemporaryDirectory(prefix="clustertrain-bench-gpu-") as tmp:
        for name in names:
            rows, device, dtype, peak = {}, "?", "?", None
            for runner in RUNNERS:
                print(f"{name}: running {runner} ...", flush=True)
                result, error = child(args, name, runner, Path(tmp) / f"{name}-{runner}.json")
                if result is None:
                    print(error, file=sys.stderr, flush=True)
                    failed = True
                    rows[runner] = None
                    continue
                device, dtype = result["device"], result["dtype"]
                peak = peak or result["peak_flops"]
                rows[runner] = summarize(result, args.warmup, peak)
            print_table(shape(WORKLOADS[name], args.tiny), rows, device, dtype, args)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
