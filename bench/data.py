""".venv/bin/python bench/data.py

Is the data loader ever what a training step waits for, and does resuming cost the same at any depth?

    .venv/bin/python bench/data.py --rounds 5 --batches-per-round 1000
    .venv/bin/python bench/data.py --docs 200000 --restore-steps 10,100,1000,10000 --reps 7
    .venv/bin/python bench/data.py --no-sft

Everything runs in one process on this machine (CPU, or whatever `parallel.device` picks for the trainer).

1. Loader throughput against training consumption. The layout is the demo's: global batch 16 x seq_len 128
   on 2 data-parallel ranks, so one rank's `StreamLoader(plan, dp_rank=0, dp_size=2)` serves 8 streams
   (8 rows of 128 tokens per batch). It is timed with `num_workers` 0 (tokenizing and packing in the
   calling process) and 1 (the default: one DataLoader worker process) on
     * pretrain, stdlib: the embedded default config (the Python standard library's sources),
     * pretrain, jsonl: the generated jsonl of part 2 (small documents, so windows of `data.shuffle_buffer`
       documents turn over every few hundred batches),
     * sft, jsonl: generated prompt/completion records, `data.mode=sft` (skip with --no-sft).
   The first batch of a loader is its warm-up (worker start, and the first window of every stream read and
   tokenized) and is reported on its own; the timed batches come after it, and span several windows per
   stream where the source has them (the `windows` column counts the window loads, i.e. tokenizations of
   `data.shuffle_buffer` documents, per stream inside the timed span). The stdlib corpus has few, large
   documents: each stream's slice is a single window, tokenized once and kept across epochs, so after the
   first batch that loader only packs. Rates are the timed tokens over the timed seconds (all rounds);
   `max ms` is the slowest single batch, the longest a step could wait on the loader; it is printed against
   the median training step, with the lowest loader/consumption ratio of the table.
   Consumption is the real trainer: `Trainer(cfg).build()`, `.start(None)`, then `train_steps(n)` per round
   on the same config in one process (which uses both cores), median over rounds. With 2 ranks on the machine
   each rank trains its 8 rows at about the same step rate, so a rank consumes about half that:
   `ratio = loader tokens/s / (trainer tokens/s / 2)`; it must be far above 1. Loader and trainer rounds
   alternate, the order rotating every round, so a noisy machine slows both alike. The pretrain jsonl rows
   are compared with the default trainer (same model, same tokenizer, same batch shape).
2. Restore cost does not grow with the steps taken. A large jsonl source (--docs documents of a few hundred
   bytes) is generated in a temp dir; a plan over it with the default tokenizer (the one the default config
   trains and caches), a `StreamLoader` with dp 1 and `num_workers=0` runs to each depth S, its position
   `global_state([local_state()])` is taken, and the batch it serves next is kept. Then, round-robin over the
   depths for --reps repetitions: a fresh `DataPlan` + `StreamLoader` + `load_state_dict` + the first
   `next_batch()` is timed (the whole cost of resuming; the tokenizer object is reused, the shuffle cache
   emptied), and that first batch must equal the kept one (input_ids, labels, position_ids, origins).
   Reported: the median (min, max) per depth, the part of it spent before the first batch (plan + load),
   and the ratio deepest / shallowest (of the medians, and of the best restores).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from clustertrain.data.loader import StreamLoader  # noqa: E402
from clustertrain.data.mixture import window_permutation  # noqa: E402
from clustertrain.data.plan import DataPlan  # noqa: E402
from clustertrain.data.sources import stdlib_files  # noqa: E402
from clustertrain.data.tokenize import cache_root, load_tokenizer, tokenizer_dir  # noqa: E402
from clustertrain.resolve.load import load_checked_config  # noqa: E402
from clustertrain.train.trainer import Trainer  # noqa: E402

DP_SIZE = 2  # the demo's layout: `clustertrain train --nproc 2`
FAR_ABOVE = 5.0  # a loader/consumption ratio below this is flagged
FLAT = 1.5  # a deepest/shallowest restore ratio above this is flagged
DESCRIPTION = "data loader tokens/s against the trainer's consumption, and resume cost against steps taken"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of part 1 (default 3)")
    p.add_argument("--batches-per-round", type=int, default=600,
                   help="loader batches per loader per round (default 600; x rounds = the timed span)")
    p.add_argument("--steps-per-round", type=int, default=4, help="trainer steps per round (default 4)")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed trainer steps first (default 2)")
    p.add_argument("--docs", type=int, default=100_000, help="documents of the generated jsonl (default 100000)")
    p.add_argument("--sft-records", type=int, default=30_000, help="records of the generated SFT jsonl (default 30000)")
    p.add_argument("--restore-steps", default="10,100,1000,4000",
                   help="comma-separated depths at which the position is taken (default 10,100,1000,4000)")
    p.add_argument("--reps", type=int, default=3, help="restore repetitions per depth (default 3)")
    p.add_argument("--no-sft", action="store_true", help="leave out the data.mode=sft rows")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="config override for every config here, as `clustertrain train --set` (repeatable)",
    )
    args = p.parse_args(argv)
    try:
        args.restore_steps = sorted({int(s) for s in args.restore_steps.split(",") if s.strip()})
    except ValueError:
        p.error("--restore-steps must be comma-separated integers, e.g. 10,100,1000")
    if len(args.restore_steps) < 2 or args.restore_steps[0] < 1:
        p.error("--restore-steps needs at least two depths >= 1")
    if min(args.rounds, args.batches_per_round, args.steps_per_round, args.reps, args.docs) < 1:
        p.error("--rounds, --batches-per-round, --steps-per-round, --reps and --docs must be >= 1")
    return args


# ---- generated sources -------------------------------------------------------------------------


def _vocabulary() -> tuple[np.ndarray, np.ndarray]:
    """Words of the standard library's sources (text the default tokenizer knows), most frequent first, and
    Zipf-like probabilities for drawing them."""
    counts: Counter = Counter()
    for path in stdlib_files()[:120]:
        counts.update(re.findall(r"\b[a-z]{2,10}\b", path.read_text(errors="replace")))
    words = np.array([w for w, _ in counts.most_common(5000)])
    p = 1.0 / (np.arange(len(words)) + 5.0)
    return words, p / p.sum()


def write_pretrain_jsonl(path: Path, n: int, seed: int = 0) -> None:
    """n documents {"text": ...} of 20-70 words (a few hundred bytes) each."""
    rng = np.random.default_rng(seed)
    vocab, p = _vocabulary()
    lengths = rng.integers(20, 70, n)
    words = vocab[rng.choice(len(vocab), int(lengths.sum()), p=p)].tolist()
    ends = np.cumsum(lengths).tolist()
    with open(path, "w") as f:
        start = 0
        for i, end in enumerate(ends):
            f.write(f'{{"text": "Document {i}. {" ".join(words[start:end])}."}}\n')
            start = end


def write_sft_jsonl(path: Path, n: int, seed: int = 1) -> None:
    """n {"prompt", "completion"} records, short enough that several pack into one 128-token sequence."""
    rng = np.random.default_rng(seed)
    vocab, p = _vocabulary()
    q_len, a_len = rng.integers(3, 10, n), rng.integers(2, 12, n)
    words = vocab[rng.choice(len(vocab), int(q_len.sum() + a_len.sum()), p=p)].tolist()
    with open(path, "w") as f:
        at = 0
        for i, (nq, na) in enumerate(zip(q_len.tolist(), a_len.tolist())):
            q, a = " ".join(words[at : at + nq]), " ".join(words[at + nq : at + nq + na])
            at += nq + na
            f.write(json.dumps({"prompt": f"Question {i}: what follows {q}?\nAnswer:", "completion": f" {a}."}) + "\n")


# ---- part 1: loader against trainer ------------------------------------------------------------


class LoaderSide:
    """One rank's StreamLoader; each call serves a number of batches and adds them to the timed totals."""

    def __init__(self, name: str, cfg, tokenizer, workers: int, consumer: str):
        self.name, self.workers, self.consumer = name, workers, consumer
        seed = cfg.data_seed
        self.plan = DataPlan(cfg.data, tokenizer, cfg.train.global_batch_size, seed, cache_root(cfg.data))
        self.loader = StreamLoader(self.plan, 0, DP_SIZE, workers)
        self.buffer = cfg.data.shuffle_buffer
        self.slices = [self.plan.stream(s, "train").packers[0].cursor.orders[0].length for s in self.loader.stream_ids]
        self.rows_tokens = len(self.loader.stream_ids) * cfg.data.seq_len
        start = time.perf_counter()
        self.loader.next_batch()  # warm-up: worker start, first window of every stream
        self.first_s = time.perf_counter() - start
        self.start_windows = self._windows()
        self.seconds, self.batches, self.max_batch_s = 0.0, 0, 0.0

    def _windows(self) -> list[int]:
        """Per stream: the ordinal of the window under its cursor (windows loaded so far, minus one)."""
        out = []
        for s, length in zip(self.loader.stream_ids, self.slices):
            epoch, pos = self.loader.local_state()["streams"][s]["lanes"][0]["cursor"]["positions"][0]
            per_epoch = -(-length // self.buffer)
            out.append(epoch * per_epoch + pos // self.buffer if per_epoch > 1 else 0)  # one window: kept
        return out

    def run(self, batches: int) -> None:
        longest = 0.0
        start = last = time.perf_counter()
        for _ in range(batches):
            self.loader.next_batch()
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
        self.seconds += last - start
        self.batches += batches
        self.max_batch_s = max(self.max_batch_s, longest)

    @property
    def rate(self) -> float:
        return self.batches * self.rows_tokens / self.seconds

    @property
    def window_loads(self) -> float:
        return statistics.mean(b - a for a, b in zip(self.start_windows, self._windows()))

    def close(self) -> None:
        self.loader._iterator = None  # shuts a worker down


class TrainerSide:
    """The real training loop on one config: `train_steps(n)` timed per round."""

    def __init__(self, cfg):
        self.t = Trainer(cfg)
        self.t.build()
        with contextlib.redirect_stdout(io.StringIO()):
            self.t.start(None)
        self.rates: list[float] = []

    def warmup(self, steps: int) -> None:
        self.t.train_steps(steps)

    def run(self, steps: int) -> None:
        start = time.perf_counter()
        self.t.train_steps(steps)
        if self.t.place.device.type == "cuda":
            torch.cuda.synchronize(self.t.place.device)
        self.rates.append(steps * self.t.config.tokens_per_step / (time.perf_counter() - start))

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)

    def close(self) -> None:
        self.t.data.loader._iterator = None
        self.t.close()


def measure_phase(args, trainer_name: str, trainer_cfg, loader_specs, tokenizer, rates: dict, rows: list) -> None:
    """Build a trainer and its loaders, then alternate rounds of trainer steps and loader batches."""
    trainer = TrainerSide(trainer_cfg)
    loaders = []
    try:
        trainer.warmup(args.warmup_steps)
        for name, cfg in loader_specs:
            for workers in (0, 1):
                loaders.append(LoaderSide(name, cfg, tokenizer, workers, trainer_name))
        sides = [trainer, *loaders]
        for r in range(args.rounds):
            shift = r % len(sides)
            for side in sides[shift:] + sides[:shift]:
                side.run(args.steps_per_round if side is trainer else args.batches_per_round)
        rates[trainer_name] = (trainer.rate, min(trainer.rates), max(trainer.rates))
        rows.extend(loaders)
    finally:
        for side in loaders:
            side.close()
        trainer.close()


def print_part1(args, rows: list[LoaderSide], rates: dict, step_tokens: int) -> float:
    print()
    print(f"1. loader vs training consumption: rank 0 of {DP_SIZE} ({len(rows[0].loader.stream_ids)} streams x "
          f"{rows[0].rows_tokens // len(rows[0].loader.stream_ids)} tokens per batch); {args.rounds} rounds x "
          f"{args.batches_per_round} batches timed per loader after its first batch; trainer {args.rounds} rounds "
          f"x {args.steps_per_round} steps after {args.warmup_steps} warm-up steps")
    for name, (med, lo, hi) in rates.items():
        print(f"   trainer {name}: {med:,.0f} tokens/s in one process (median; rounds {lo:,.0f}..{hi:,.0f}) "
              f"-> {med / DP_SIZE:,.0f} tokens/s per rank with {DP_SIZE} ranks ({step_tokens} tokens/step)")
    header = (f"{'data':<16} {'workers':>7} {'docs/stream':>11} {'windows':>7} {'first ms':>8} {'max ms':>7} "
              f"{'loader tok/s':>13} {'rank consumes':>13} {'ratio':>7}")
    print()
    print(header)
    print("-" * len(header))
    headline = None
    for side in rows:
        per_rank = rates[side.consumer][0] / DP_SIZE
        ratio = side.rate / per_rank
        if side.name == "pretrain stdlib" and side.workers == 1:
            headline = ratio
        print(f"{side.name:<16} {side.workers:>7} {round(statistics.mean(side.slices)):>11} "
              f"{side.window_loads:>7.1f} {1000 * side.first_s:>8.0f} {1000 * side.max_batch_s:>7.1f} "
              f"{side.rate:>13,.0f} {per_rank:>13,.0f} {ratio:>6.0f}x")
    print("-" * len(header))
    print(f"windows: window loads (tokenizing up to data.shuffle_buffer = {rows[0].buffer} documents) per stream "
          f"inside the timed span; 0 where a stream's slice is one window, tokenized once in the first batch")
    lowest = min(rows, key=lambda s: s.rate / (rates[s.consumer][0] / DP_SIZE))
    print(f"lowest ratio: {lowest.name}, num_workers {lowest.workers}: "
          f"{lowest.rate / (rates[lowest.consumer][0] / DP_SIZE):.0f}x")
    for name, (med, _, _) in rates.items():
        slowest = max((s for s in rows if s.consumer == name), key=lambda s: s.max_batch_s)
        print(f"slowest single batch ({name}): {1000 * slowest.max_batch_s:.0f} ms ({slowest.name}, num_workers "
              f"{slowest.workers}: window loads in one next_batch) vs a training step of "
              f"{1000 * step_tokens / med:.0f} ms (median)")
    low = [f"{s.name}/{s.workers}" for s in rows if s.rate / (rates[s.consumer][0] / DP_SIZE) < FAR_ABOVE]
    if low:
        print(f"note: loader/consumption below {FAR_ABOVE:.0f}x for {', '.join(low)}")
    return headline if headline is not None else float("nan")


# ---- part 2: restore cost ----------------------------------------------------------------------


def same_batch(a: dict, b: dict) -> bool:
    tensors = all(torch.equal(a[k], b[k]) for k in ("input_ids", "labels", "position_ids"))
    return tensors and a["origins"] == b["origins"]


def measure_restore(args, cfg, tokenizer) -> tuple[list[tuple], float]:
    """Positions at each depth from one forward run, then timed fresh restores, round-robin over depths."""
    seed = cfg.data_seed
    k = cfg.train.global_batch_size
    plan = DataPlan(cfg.data, tokenizer, k, seed, cache_root(cfg.data))
    loader = StreamLoader(plan, 0, 1, 0)
    snapshots = {}
    start = time.perf_counter()
    for depth in args.restore_steps:
        while loader.batches < depth:
            loader.next_batch()
        state = copy.deepcopy(loader.global_state([loader.local_state()]))
        snapshots[depth] = (state, loader.next_batch())
    forward_s = time.perf_counter() - start
    served = loader.batches
    buffer = cfg.data.shuffle_buffer
    del loader, plan

    timings: dict[int, list[tuple[float, float]]] = {d: [] for d in args.restore_steps}
    for rep in range(args.reps):
        order = args.restore_steps if rep % 2 == 0 else args.restore_steps[::-1]
        for depth in order:
            state, expected = snapshots[depth]
            window_permutation.cache_clear()  # a resumed process starts without the shuffles of the old one
            t0 = time.perf_counter()
            plan = DataPlan(cfg.data, tokenizer, k, seed, cache_root(cfg.data))
            restored = StreamLoader(plan, 0, 1, 0)
            restored.load_state_dict(state)
            t1 = time.perf_counter()
            batch = restored.next_batch()
            t2 = time.perf_counter()
            if not same_batch(batch, expected):
                raise SystemExit(f"restore at {depth} steps is not exact: its first batch differs from the batch the "
                                 "original loader served next")
            timings[depth].append((t2 - t0, t1 - t0))
    table = []
    for depth in args.restore_steps:
        state = snapshots[depth][0]
        cursors = [s["lanes"][0]["cursor"]["positions"][0] for s in state["streams"]]
        epoch = statistics.mean(e for e, _ in cursors)
        window = statistics.mean(p // buffer for _, p in cursors)
        totals = [t for t, _ in timings[depth]]
        opens = [o for _, o in timings[depth]]
        table.append((depth, epoch, window, statistics.median(totals), min(totals), max(totals),
                      statistics.median(opens)))
    return table, served * k * cfg.data.seq_len / forward_s


# ---- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="clustertrain-bench-data-") as tmp:
        tmp_path = Path(tmp)
        common = ["train.resume=none", "train.eval_every=0", "train.sample_tokens=0", "checkpoint.every=0",
                  "metrics.progress=none", *args.overrides]
        default = load_checked_config(None, [f"train.run_dir={tmp_path / 'run-default'}", *common])
        tokenizer = load_tokenizer(default.data)  # trained once and cached, as a first run does
        tok_dir = tokenizer_dir(default.data)
        if default.data.mode != "pretrain":
            raise SystemExit("this benchmark compares pretrain and sft data; leave data.mode at its default")

        t0 = time.perf_counter()
        big = tmp_path / "docs.jsonl"
        write_pretrain_jsonl(big, args.docs)
        gen_big = time.perf_counter() - t0
        t0 = time.perf_counter()
        sft = tmp_path / "sft.jsonl"
        if not args.no_sft:
            write_sft_jsonl(sft, args.sft_records)
        gen_sft = time.perf_counter() - t0

        def over(path: Path, run: str, *extra: str):
            return load_checked_config(None, [
                f"train.run_dir={tmp_path / run}", *common, f"data.sources=[{{path: '{path}'}}]",
                f"data.tokenizer={tok_dir}", f"data.cache_dir={tmp_path / 'cache'}", *extra,
            ])

        jsonl_cfg = over(big, "run-jsonl")
        t0 = time.perf_counter()
        DataPlan(jsonl_cfg.data, tokenizer, jsonl_cfg.train.global_batch_size, jsonl_cfg.train.seed,
                 cache_root(jsonl_cfg.data))  # scans the file once for its line index, cached for the rest
        index_s = time.perf_counter() - t0

        print(f"data: default config = {default.data.sources[0].label} ({default.data.sources[0].max_bytes or 0:,} "
              f"bytes max), tokenizer {tok_dir.name} (vocab {len(tokenizer)}), batch {default.train.global_batch_size} "
              f"x {default.data.seq_len}, shuffle_buffer {default.data.shuffle_buffer}, num_workers default "
              f"{default.data.num_workers} | torch {torch.__version__}, {torch.get_num_threads()} threads")
        print(f"generated: {big.name} {args.docs:,} documents, {big.stat().st_size / 1e6:.1f} MB in {gen_big:.1f}s "
              f"(line index scan {index_s:.1f}s)"
              + ("" if args.no_sft else f"; {sft.name} {args.sft_records:,} prompt/completion records, "
                 f"{sft.stat().st_size / 1e6:.1f} MB in {gen_sft:.1f}s"))

        rates: dict[str, tuple[float, float, float]] = {}
        rows: list[LoaderSide] = []
        measure_phase(args, "pretrain", default, [("pretrain stdlib", default), ("pretrain jsonl", jsonl_cfg)],
                      tokenizer, rates, rows)
        if not args.no_sft:
            sft_cfg = over(sft, "run-sft", "data.mode=sft")
            measure_phase(args, "sft", sft_cfg, [("sft jsonl", sft_cfg)], tokenizer, rates, rows)
        headline = print_part1(args, rows, rates, default.tokens_per_step)

        restore_cfg = over(big, "run-restore")
        table, forward_rate = measure_restore(args, restore_cfg, tokenizer)
        k = restore_cfg.train.global_batch_size
        print()
        print(f"2. restore cost vs steps taken: {big.name}, dp 1 ({k} streams), num_workers 0; positions from one "
              f"forward run ({forward_rate:,.0f} tokens/s); {args.reps} restores per depth, round-robin; restore = "
              f"fresh DataPlan + StreamLoader + load_state_dict + first next_batch, checked equal to the original's "
              f"next batch")
        header = (f"{'steps':>7} {'epoch':>6} {'window':>7} {'restore ms':>10} {'min':>7} {'max':>7} "
                  f"{'plan+load ms':>12} {'exact':>6}")
        print()
        print(header + "   (epoch, window: mean over streams)")
        print("-" * len(header))
        for depth, epoch, window, med, lo, hi, opened in table:
            print(f"{depth:>7} {epoch:>6.2f} {window:>7.2f} {1000 * med:>10.0f} {1000 * lo:>7.0f} {1000 * hi:>7.0f} "
                  f"{1000 * opened:>12.1f} {'yes':>6}")
        print("-" * len(header))
        deep, shallow = table[-1], table[0]
        flat, flat_best = deep[3] / shallow[3], deep[4] / shallow[4]
        print(f"restore {deep[0]} / {shallow[0]} steps: median {flat:.2f}x, best {flat_best:.2f}x; every restore "
              f"re-reads and re-tokenizes one window per stream ({k} x up to {restore_cfg.data.shuffle_buffer} "
              "documents), whatever the depth")

        print()
        print(f"total {time.perf_counter() - t_start:.0f}s")
        if min(flat, flat_best) > FLAT:
            print(f"note: the deepest restore is more than {FLAT}x the shallowest (a busy machine, or a real growth)")
        print(f"loader/consumption per rank: {headline:.0f}x  (pretrain stdlib, num_workers "
              f"{default.data.num_workers}, rank 0 of {DP_SIZE})")
        print(f"restore at {deep[0]} steps / at {shallow[0]} steps: {flat:.1f}x  (median; best-of {flat_best:.1f}x; "
              "exact at every depth)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
