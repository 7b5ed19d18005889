""".venv/bin/python bench/throughput.py

Does clustertrain add anything to a training step? Its loop against a minimal hand-written PyTorch loop.

    .venv/bin/python bench/throughput.py --rounds 6 --steps-per-round 20
    .venv/bin/python bench/throughput.py --set 'model.config={hidden_size: 256, intermediate_size: 688,
        num_hidden_layers: 4, num_attention_heads: 4, num_key_value_heads: 4, max_position_embeddings: 1024}'

One process, one rank, CPU (or whatever `parallel.device` picks), one model and one batch shape for both sides:

* clustertrain: `Trainer(cfg).build()` and `.start(None)`, then `Trainer.train_steps(n)` per round: the
  real step path with the lr schedule, `StreamLoader.next_batch`, `train_step` (token count,
  microbatches with gradient accumulation, global-norm clip, AdamW) and the metrics call every
  `metrics.log_every` steps (JSONL and TensorBoard writes). Evaluation, checkpoints and the end-of-run
  sample are off; the progress display is `none`.
* hand-written: a model built with `AutoModelForCausalLM.from_config` from the same HF config and loaded
  with the trainer's initial weights, plain `torch.optim.AdamW(model.parameters(), foreach=True)` with
  the same hyperparameters (one group, constant lr), batches of the same shape pre-built in memory from
  the same packed token data, the same micro-batch split with gradient accumulation, mean cross entropy
  scaled by 1/microbatches, `clip_grad_norm_`, `step`, `zero_grad`. No logging, no data loading. A
  `parallel.param_dtype` other than float32 runs it under `torch.autocast`; with a zero2/zero3 strategy the
  clustertrain side is FSDP-wrapped (on one rank) while this side stays a plain module.

Both sides are warmed up, then run in alternating rounds (the side that goes first swaps every round) so
that a noisy, shared machine slows both alike. Reported: tokens/s per round, the median, min and max per
side, the per-round paired ratio, the ratio of the best rounds, and the ratio of the medians (clustertrain / hand-written). The
project's bar is a ratio >= 0.97; the aim is 1.0.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from clustertrain.data.loader import StreamLoader  # noqa: E402
from clustertrain.parallel.apply import DTYPES, unwrap  # noqa: E402
from clustertrain.resolve.load import load_checked_config  # noqa: E402
from clustertrain.train.metrics import read_metrics  # noqa: E402
from clustertrain.train.trainer import Trainer  # noqa: E402

BAR = 0.97
NOISY = 0.15  # (max - min) / median of a side above which the ratio is flagged as noisy
DESCRIPTION = "tokens/s of clustertrain's training loop against a hand-written PyTorch loop, interleaved"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("--rounds", type=int, default=10, help="timed rounds per side (default 10)")
    p.add_argument("--steps-per-round", type=int, default=10, help="optimizer steps per round (default 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per side first (default: --steps-per-round)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="config override, as `clustertrain train --set` (repeatable), e.g. train.micro_batch_size=4",
    )
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps_per_round < 1:
        p.error("--rounds and --steps-per-round must be >= 1")
    if args.warmup is None:
        args.warmup = args.steps_per_round
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (the first steps allocate and import)")
    return args


class ClustertrainSide:
    """Runs the trainer's real step path, `Trainer.train_steps`, for a number of steps per call."""

    name = "clustertrain"

    def __init__(self, trainer: Trainer):
        self.t = trainer
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.start(None)  # opens the metrics sinks once, as a real run does

    def run(self, steps: int) -> float:
        """Seconds for `steps` optimizer steps, metrics on their schedule included."""
        start = time.perf_counter()
        self.t.train_steps(steps)
        if self.t.place.device.type == "cuda":
            torch.cuda.synchronize(self.t.place.device)
        return time.perf_counter() - start

    @property
    def last_loss(self) -> float:
        records = [r for r in read_metrics(self.t.files.metrics) if r.get("loss") is not None]
        return records[-1]["loss"]

    def logged_losses(self) -> int:
        """Metrics calls the loop made so far (records with a loss in metrics.jsonl)."""
        return sum(r.get("loss") is not None for r in read_metrics(self.t.files.metrics))


class HandWrittenSide:
    """The same model, optimizer hyperparameters and batch shape in the plainest PyTorch loop."""

    name = "hand-written"

    def __init__(self, trainer: Trainer, n_batches: int = 8):
        from transformers import AutoModelForCausalLM

        cfg = trainer.config
        self.device = trainer.place.device
        self.model = AutoModelForCausalLM.from_config(
            trainer.model.runner.model.config, attn_implementation=trainer.model.runner.model.config._attn_implementation, dtype=torch.float32
        ).to(self.device)
        self.model.load_state_dict(full_state(trainer.model.runner.model))  # the trainer's initial weights
        self.model.train()
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, foreach=True
        )
        self.grad_clip = o.grad_clip if o.grad_clip > 0 else float("inf")
        self.micro = trainer.place.layout.micro_batch
        # A lower-precision param_dtype is run under autocast, as clustertrain does for DDP.
        dtype = DTYPES[cfg.parallel.param_dtype]
        self.autocast = None if dtype == torch.float32 else dtype
        # Global batches of the same shape from the same data, built once in memory, cycled through.
        loader = StreamLoader(trainer.data.plan, dp_rank=0, dp_size=1)
        self.batches = []
        for _ in range(n_batches):
            batch = loader.next_batch()
            self.batches.append((batch["input_ids"].to(self.device), batch["labels"].to(self.device)))
        self.next = 0
        self.last_loss: float | None = None

    def run(self, steps: int) -> float:
        """Seconds for `steps` optimizer steps."""
        model, opt = self.model, self.optimizer
        start = time.perf_counter()
        for _ in range(steps):
            x, y = self.batches[self.next % len(self.batches)]
            self.next += 1
            n_micro = -(-x.shape[0] // self.micro)
            losses = []
            for i in range(n_micro):
                rows = slice(i * self.micro, (i + 1) * self.micro)
                with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
                    logits = model(input_ids=x[rows]).logits
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), y[rows].flatten()) / n_micro
                loss.backward()
                losses.append(loss.detach())
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.grad_clip, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.last_loss = float(sum(losses))
        return elapsed


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with sharded (DTensor) entries gathered, so a plain model can load it."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in unwrap(model).state_dict().items()}


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = full_state(a), full_state(b)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    needed = args.warmup + args.rounds * args.steps_per_round
    with tempfile.TemporaryDirectory(prefix="clustertrain-bench-") as run_dir:
        overrides = [
            f"train.run_dir={run_dir}",
            "train.resume=none",
            f"train.steps={max(300, needed)}",
            "train.eval_every=0",
            "train.sample_tokens=0",
            "checkpoint.every=0",
            "metrics.progress=none",
            *args.overrides,
        ]
        cfg = load_checked_config(None, overrides)
        t0 = time.perf_counter()
        trainer = Trainer(cfg)
        try:
            trainer.build()
            if trainer.total_steps < needed:
                raise SystemExit(f"the run has {trainer.total_steps} steps but the benchmark needs {needed}; "
                                 f"raise train.steps / train.tokens or lower --rounds / --steps-per-round")
            if cfg.train.eval_every or cfg.checkpoint.every:
                print("note: evaluation / periodic checkpoints are on and are timed with clustertrain's steps")
            hand = HandWrittenSide(trainer)
            assert same_weights(trainer.model.runner.model, hand.model), "the two models do not start from the same weights"
            ct = ClustertrainSide(trainer)
            sides = (ct, hand)
            build_s = time.perf_counter() - t0

            tokens_per_step = trainer.config.tokens_per_step
            p = trainer.model.params["total"]
            hf = trainer.model.runner.model.config
            print(f"model: {cfg.model.arch} {p / 1e6:.2f}M params (hidden {getattr(hf, 'hidden_size', '?')}, "
                  f"{getattr(hf, 'num_hidden_layers', '?')} layers, vocab {hf.vocab_size})")
            print(f"batch {cfg.train.global_batch_size} x {cfg.data.seq_len} = {tokens_per_step} tokens/step, "
                  f"micro {trainer.place.layout.micro_batch} | device {trainer.place.device.type}, {torch.get_num_threads()} "
                  f"threads | torch {torch.__version__}")
            print(f"built in {build_s:.1f}s; warmup {args.warmup} steps per side, then {args.rounds} rounds x "
                  f"{args.steps_per_round} steps per side, alternating order; metrics.log_every="
                  f"{cfg.metrics.log_every}")

            for side in sides:
                side.run(args.warmup)
            logged_before = ct.logged_losses()

            rates: dict[str, list[float]] = {s.name: [] for s in sides}
            tokens = tokens_per_step * args.steps_per_round
            header = f"{'round':>5}  {'first':<12}  {'clustertrain':>12}  {'hand-written':>12}  {'ratio':>6}"
            print()
            print(header + "   (tokens/s)")
            print("-" * len(header))
            for r in range(args.rounds):
                order = sides if r % 2 == 0 else sides[::-1]
                for side in order:
                    rates[side.name].append(tokens / side.run(args.steps_per_round))
                a, b = rates["clustertrain"][-1], rates["hand-written"][-1]
                print(f"{r + 1:>5}  {order[0].name:<12}  {a:>12.0f}  {b:>12.0f}  {a / b:>6.3f}", flush=True)
            print("-" * len(header))

            paired = [a / b for a, b in zip(rates["clustertrain"], rates["hand-written"])]
            med = {k: statistics.median(v) for k, v in rates.items()}
            for label, fn in (("median", statistics.median), ("min", min), ("max", max)):
                a, b = fn(rates["clustertrain"]), fn(rates["hand-written"])
                print(f"{label:>5}  {'':<12}  {a:>12.0f}  {b:>12.0f}  {fn(paired):>6.3f}")
            spread = {k: (max(v) - min(v)) / med[k] for k, v in rates.items()}
            ratio = med["clustertrain"] / med["hand-written"]
            verdict = "meets" if ratio >= BAR else "is BELOW"
            print()
            print(f"spread (max-min)/median: clustertrain {100 * spread['clustertrain']:.1f}%, "
                  f"hand-written {100 * spread['hand-written']:.1f}%")
            print(f"last loss: clustertrain {ct.last_loss:.4f} (step {trainer.step}), hand-written "
                  f"{hand.last_loss:.4f}; clustertrain metrics calls in the timed steps: {ct.logged_losses() - logged_before}")
            best = max(rates["clustertrain"]) / max(rates["hand-written"])
            print(f"median paired ratio {statistics.median(paired):.3f}, ratio of best rounds {best:.3f}; "
                  f"ratio of medians {ratio:.3f} {verdict} the bar of {BAR}")
            if max(spread.values()) > NOISY:
                print(f"note: rounds varied by more than {100 * NOISY:.0f}% (a busy machine?); the ratio carries that "
                      "noise: rerun on a quiet machine or with more --rounds")
            print(f"ratio clustertrain/hand-written: {ratio:.2f}")
        finally:
            trainer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
