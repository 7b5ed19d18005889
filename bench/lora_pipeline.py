""".venv/bin/python bench/lora_pipeline.py

OPT-2.7B's shape under LoRA (r 8) in 2 pipeline stages on 2 CPU ranks of this machine, measured against the plan:
each setting's peak resident memory per rank beside `clustertrain plan`'s peak of that rank's stage.

    .venv/bin/python bench/lora_pipeline.py                       # 8 of the 32 layers: 12 settings, ~35 min on 2 cores
    .venv/bin/python bench/lora_pipeline.py --layers 4 --dtypes float32 --micro 1 --modes none,full

The run: configs/opt-pp-lora-cpu.yaml with OPT-2.7B's config.json shape (hidden 2560, ffn 10240, 32 heads,
vocab 50272, max position 2048; `--layers` of its 32 decoder layers, random weights), seq 512, 1f1b over 2
microbatches, for each dtype (`parallel.param_dtype`: the frozen base in it, the adapters in float32, autocast
when not float32), micro batch and activation checkpointing. Each setting starts 2 fresh ranks (peak RSS is per
process) that build, lay out and step as the trainer does (`build_model`, `parallelize`, `build_optimizer`,
`train_step`); "measured" is a rank's peak resident memory during its steps above its resident memory before the
model was built (what the trainer's plan check compares, `train/plan_check.py`), "plan" the planned peak of that
rank's stage (`plan.plan.measure_stage`). Threads: one per rank.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

OPT_2_7B = ("{{hidden_size: 2560, ffn_dim: 10240, num_hidden_layers: {layers}, num_attention_heads: 32, "
            "word_embed_proj_dim: 2560, max_position_embeddings: 2048, vocab_size: 50272}}")
# glibc returns freed blocks of 64 KB and more to the system at once, so the resident peak follows the live tensors
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}


def overrides(layers: int, dtype: str, micro: int, mode: str) -> list[str]:
    return ["model.hub_id=null", "model.arch=opt", f"model.config={OPT_2_7B.format(layers=layers)}",
            "lora.rank=8", "parallel.pp=2", "parallel.pp_schedule=1f1b", f"parallel.param_dtype={dtype}",
            f"parallel.activation_checkpoint={mode}", f"train.micro_batch_size={micro}", "train.grad_accum=2",
            "data.seq_len=512"]


def resolved(sets: list[str]):
    from clustertrain.resolve.load import load_checked_config
    from clustertrain.resolve.run import resolve

    run = resolve(load_checked_config(ROOT / "configs/opt-pp-lora-cpu.yaml", sets), 2, 2, "cpu")
    return run.config, run.layout


def measure(sets: list[str], steps: int) -> dict:
    """This rank's peak RSS during `steps` training steps, above its RSS before the model (in a 2-rank world)."""
    import torch

    from clustertrain.distributed.env import detect_launcher
    from clustertrain.distributed.init import init_distributed
    from clustertrain.distributed.mesh import build_mesh
    from clustertrain.model.build import block_classes, build_model
    from clustertrain.model.loss import TokenLoss
    from clustertrain.model.weights import materialize
    from clustertrain.parallel.apply import DTYPES, parallelize
    from clustertrain.train.memory import PeakMemory, resident_bytes
    from clustertrain.train.optim import build_optimizer
    from clustertrain.train.step import train_step

    config, layout = resolved(sets)
    device = init_distributed(config.parallel, detect_launcher())
    mesh = build_mesh(layout, "cpu")
    before = resident_bytes()
    built = build_model(config.model, config.lora, None, config.data.vocab_size,
                        param_dtype=DTYPES[config.parallel.param_dtype], device=device, loss=config.train.loss,
                        loss_chunk_tokens=config.train.loss_chunk_tokens, pipeline=True)
    runner = parallelize(built.model, config.parallel, mesh, device, block_classes(built.model),
                         lambda m: materialize(m, device, config.train.seed, None), loss=TokenLoss(),
                         microbatches=layout.grad_accum)
    optimizer = build_optimizer(runner.parts, config.optim)
    rows, vocab = layout.micro_batch * layout.grad_accum, built.hf_config.vocab_size
    batch = {"input_ids": torch.randint(0, vocab, (rows, config.data.seq_len)),
             "labels": torch.randint(0, vocab, (rows, config.data.seq_len))}
    peak = PeakMemory(device)
    peak.read_and_reset()  # the steps' peak only, as the trainer's metrics (the weights' init left out)
    for _ in range(steps):
        train_step(runner, optimizer, batch, dp_size=1, dp_group=mesh.dp_group, grad_clip=1.0)
    return {"measured": peak.read_and_reset()["mem_gb"] * 1e9 - before}


def planned(sets: list[str]) -> list[int]:
    """The planned peak of each stage's rank."""
    from clustertrain.plan.plan import measure_stage

    config, layout = resolved(sets)
    return [measure_stage(config, layout, rank).peak for rank in (0, 1)]


def run_ranks(sets: list[str], steps: int) -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, __file__, "--steps", str(steps), "--one", json.dumps(sets)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **ENV, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for rank in (0, 1)]
    outputs = [rank.communicate() for rank in ranks]
    for rank, (out, err) in zip(ranks, outputs):
        if rank.returncode:
            raise SystemExit(f"{sets} failed: {err.strip()[-3000:]}")
    return [json.loads(out.splitlines()[-1])["measured"] for out, _ in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--micro", default="1,2")
    parser.add_argument("--modes", default="none,full,selective")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a rank: measure this JSON list of overrides
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(json.loads(args.one), args.steps)))
        return
    print(f"OPT-2.7B shape, {args.layers} layers, LoRA r 8, pp 2 (1f1b, 2 microbatches of micro batch x 512 tokens)")
    print(f"{'dtype':<9} {'micro':>5} {'checkpoint':<10} {'rank':>4} {'measured GB':>11} {'plan GB':>8} "
          f"{'plan/meas':>9}")
    settings = itertools.product(args.dtypes.split(","), map(int, args.micro.split(",")), args.modes.split(","))
    for dtype, micro, mode in settings:
        sets = overrides(args.layers, dtype, micro, mode)
        plan = planned(sets)
        for rank, measured in enumerate(run_ranks(sets, args.steps)):
            print(f"{dtype:<9} {micro:>5} {mode:<10} {rank:>4} {measured / 1e9:>11.2f} {plan[rank] / 1e9:>8.2f} "
                  f"{plan[rank] / measured:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
