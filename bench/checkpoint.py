""".venv/bin/python bench/checkpoint.py

What does a checkpoint cost? Save throughput against the disk's own write speed, and how long async and sync
saves block the training loop.

    .venv/bin/python bench/checkpoint.py --dir /scratch/$USER      # measure the file system you will save to
    .venv/bin/python bench/checkpoint.py --reps 5 --rounds 3 --steps 12 --every 4
    .venv/bin/python bench/checkpoint.py --set train.global_batch_size=8 --set train.micro_batch_size=8

One process, one rank, CPU (or whatever `parallel.device` picks). The model is the default llama widened to
hidden 512 / 8 layers (about 29.5M parameters): with AdamW's two moments a checkpoint is about 355 MB. Batches
of 2 x 128 tokens keep a step short. `--warmup` (2) training steps come first, so the optimizer state exists.
Everything is written under a fresh temp folder inside `--dir` (default: the system temp dir), removed at the
end unless `--keep`. Shared disks are noisy: read the paired per-rep ratios, not one number.

1. Save throughput vs the disk, alternating `--reps` (5) times (the side that goes first swaps every time):
   * disk: the checkpoint's byte count written to one file with `os.write` of a `--chunk-mb` random buffer,
     then one `os.fsync`: the file system's plain sequential write speed, durable.
   * checkpoint: `Trainer.save(wait=True)` with a synchronous `CheckpointManager`: `write_shards`
     (get_state_dict, DCP planning, `dcp.save` into `.tmp-step-N/`) then `commit` (config, tokenizer,
     train_state.json, rename). DCP's FileSystemWriter fsyncs each data file and `.metadata`
     (sync_files=True); the fsync calls are counted and reported. The commit's own files are not fsynced.
   Each checkpoint / file is deleted and `os.sync()` called before the next measurement, untimed.
   MB/s = bytes of the committed folder / wall time; ratio = checkpoint MB/s / disk MB/s.

2. Training-blocking time, modes `none` (no saves: the baseline), `sync` and `async` (`checkpoint.async`),
   interleaved over `--rounds` (3; the mode order rotates every round). Each round is `--steps` (8) real
   `Trainer.train_steps` steps with a save every `--every` (4) steps of the round, then `finalize()` (the drain:
   the last async save's background write and commit). Measured per save: the manager's own `blocking_s`
   (write_shards only), and an independent wall-clock timer around the loop's `Trainer.save` call (which
   also includes waiting for the previous async save, and for sync saves the commit); for async saves the
   time until the background write finished. Per round: the time of the steps and the drain. Reported:
   blocking seconds per save per mode and the async/sync ratio, and the step-time overhead against `none`.
   After each async round the committed folders are checked (train_state.json and .metadata present, the
   same .distcp byte count as a sync save, no `.tmp-*` left over) and the checkpoint threads counted.
Metrics are logged only at step 1 (`metrics.log_every` is set very high): a real run also calls
`commit_if_done()` at every log step, which commits a finished write and never waits for one.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from clustertrain.checkpoint import dcp as ckpt  # noqa: E402
from clustertrain.checkpoint.manager import CheckpointManager  # noqa: E402
from clustertrain.resolve.load import load_checked_config  # noqa: E402
from clustertrain.run_dir import RunDir  # noqa: E402
from clustertrain.train.trainer import Trainer  # noqa: E402

DESCRIPTION = "checkpoint save MB/s against the disk's sequential write speed, and async vs sync blocking time"
MODEL = ("model.config={hidden_size: 512, intermediate_size: 1376, num_hidden_layers: 8, num_attention_heads: 8, "
         "num_key_value_heads: 8, max_position_embeddings: 1024}")
MODES = ("none", "sync", "async")
MB = 1e6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("--dir", default=None,
                   help="where to write (a temp folder is made inside it and removed); default the system temp dir")
    p.add_argument("--keep", action="store_true", help="leave the temp folder in place")
    p.add_argument("--reps", type=int, default=5, help="disk / checkpoint repetitions, part 1 (default 5)")
    p.add_argument("--chunk-mb", type=int, default=16, help="os.write buffer size of the disk side (default 16)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per mode, part 2 (default 3)")
    p.add_argument("--steps", type=int, default=8, help="training steps per round (default 8)")
    p.add_argument("--every", type=int, default=4, help="save every N steps of a round (default 4)")
    p.add_argument("--warmup", type=int, default=2, help="untimed training steps first (default 2)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="config override, as `clustertrain train --set` (repeatable), e.g. train.global_batch_size=8",
    )
    args = p.parse_args(argv)
    if min(args.reps, args.chunk_mb, args.rounds, args.steps, args.every, args.warmup) < 1:
        p.error("--reps, --chunk-mb, --rounds, --steps, --every and --warmup must be >= 1")
    if args.every > args.steps:
        p.error("--every must be <= --steps (a round must save at least once)")
    return args


class BenchManager(CheckpointManager):
    """A CheckpointManager that saves every `every` steps of the current round and times its parts.

    Reads the private `_pending` future to time async background writes (a benchmark may; the trainer does not).
    """

    def __init__(self, root: Path, trainer: Trainer, async_save: bool, every: int, keep_last: int | None):
        config = trainer.config.checkpoint.model_copy(update={"async_save": async_save, "every": every,
                                                              "keep_last": keep_last})
        own = trainer.checkpoints  # the trainer's manager (or the previous BenchManager): what it saves, and how
        super().__init__(RunDir(root), config, trainer.total_steps, trainer.place.device, own.extras, own.tracked,
                         log=trainer.logger.info)
        self.round_start = 0
        self.in_save = False
        self.wait_prev_s: list[float] = []   # save() waiting for the previous (async) save and committing it
        self.write_s: list[float] = []       # save start -> background write done (async), or -> commit (sync)
        self.drain_s: list[float] = []       # finalize() outside save(): the end-of-round drain

    def due(self, step: int) -> bool:
        return bool(self.config.every) and (step - self.round_start) % self.config.every == 0

    def save(self, step, tokens_seen, *, wait=False, final=False):
        start = time.perf_counter()
        if self._pending is not None:  # what CheckpointManager.save does first, timed on its own
            CheckpointManager.finalize(self)
            self.wait_prev_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        self.in_save = True
        try:
            path = super().save(step, tokens_seen, wait=wait, final=final)
        finally:
            self.in_save = False
        if self._pending is not None and self._pending[0] is not None:  # async write in flight
            self._pending[0].add_done_callback(lambda _f: self.write_s.append(time.perf_counter() - start))
        elif path is not None:
            self.write_s.append(time.perf_counter() - start)
        return path

    def finalize(self, final=False):
        pending = self._pending is not None
        start = time.perf_counter()
        path = super().finalize(final)
        if pending and not self.in_save:
            self.drain_s.append(time.perf_counter() - start)
        return path


def folder_bytes(path: Path, suffix: str = "") -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.name.endswith(suffix))


def sync_fs() -> None:
    os.sync()  # the previous measurement's dirty pages and deletions are not billed to the next one
    time.sleep(0.2)


def fs_type(path: Path) -> str:
    """The file system type and mount point that hold `path`, from /proc/mounts (Linux)."""
    best = ("", "?")
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3:
                continue
            mount = parts[1].replace("\\040", " ")
            inside = mount == "/" or str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best[0]):
                best = (mount, parts[2])
    return f"{best[1]} at {best[0] or '?'}"


def disk_write(path: Path, nbytes: int, buf: bytes) -> float:
    """Seconds to write `nbytes` sequentially in len(buf) pieces to a new file, then fsync it."""
    view = memoryview(buf)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, view[: min(left, len(view))])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


@contextlib.contextmanager
def counting_fsync():
    """Counts os.fsync calls (DCP's FileSystemWriter calls os.fsync) made inside the block, on any thread."""
    calls = []
    real = os.fsync

    def fsync(fd):
        calls.append(fd)
        return real(fd)

    os.fsync = fsync
    try:
        yield calls
    finally:
        os.fsync = real


def state_bytes(trainer: Trainer) -> tuple[int, int]:
    """Bytes of the model's and the optimizer's tensors."""
    model = sum(t.numel() * t.element_size() for t in trainer.model.runner.model.state_dict().values() if torch.is_tensor(t))
    optim = 0
    for per_param in (state for o in trainer.optim.optimizer.optimizers for state in o.state.values()):
        optim += sum(t.numel() * t.element_size() for t in per_param.values() if torch.is_tensor(t))
    return model, optim


def ckpt_threads() -> int:
    return sum(t.name.startswith("AsyncCheckpointExecutor") for t in threading.enumerate())


def part1(trainer: Trainer, root: Path, args: argparse.Namespace) -> int:
    """Disk sequential write vs a synchronous checkpoint, alternating; each output deleted before the next."""
    manager = BenchManager(root / "throughput", trainer, async_save=False, every=0, keep_last=None)
    trainer.checkpoints = manager
    # One untimed save: imports and first-call costs, and the byte count the disk side will write.
    path = trainer.save(wait=True)
    nbytes, distcp = folder_bytes(path), folder_bytes(path, ".distcp")
    shutil.rmtree(path)
    print(f"checkpoint: {nbytes / MB:.1f} MB in the committed folder ({distcp / MB:.1f} MB of .distcp data)")
    buf = os.urandom(args.chunk_mb * 1024 * 1024)
    target = root / "disk-sequential.bin"
    disk_write(target, nbytes, buf)  # untimed: the first write of a fresh file system pays extra (allocation)
    target.unlink()

    def disk() -> tuple[float, str]:
        seconds = disk_write(target, nbytes, buf)
        target.unlink()
        return nbytes / MB / seconds, ""

    def checkpoint() -> tuple[float, str]:
        with counting_fsync() as calls:
            start = time.perf_counter()
            saved = trainer.save(wait=True)
            seconds = time.perf_counter() - start
        size = folder_bytes(saved)
        shutil.rmtree(saved)
        shards = manager.blocking_s[-1]
        note = f"{seconds:.2f}s (write_shards {shards:.2f}s, commit {seconds - shards:.2f}s), {len(calls)} fsync"
        return size / MB / seconds, note

    print()
    header = f"{'rep':>3}  {'first':<10}  {'disk MB/s':>9}  {'ckpt MB/s':>9}  {'ratio':>6}  checkpoint"
    print(header)
    print("-" * (len(header) + 50))
    rates: dict[str, list[float]] = {"disk": [], "checkpoint": []}
    for rep in range(args.reps):
        order = (("disk", disk), ("checkpoint", checkpoint))
        order = order if rep % 2 == 0 else order[::-1]
        note = ""
        for name, fn in order:
            sync_fs()
            rate, text = fn()
            rates[name].append(rate)
            note = note or text
        d, c = rates["disk"][-1], rates["checkpoint"][-1]
        print(f"{rep + 1:>3}  {order[0][0]:<10}  {d:>9.0f}  {c:>9.0f}  {c / d:>6.2f}  {note}", flush=True)
    print("-" * (len(header) + 50))
    paired = [c / d for d, c in zip(rates["disk"], rates["checkpoint"])]
    for label, fn in (("med", statistics.median), ("min", min), ("max", max)):
        print(f"{label:>3}  {'':<10}  {fn(rates['disk']):>9.0f}  {fn(rates['checkpoint']):>9.0f}  {fn(paired):>6.2f}")
    ratio = statistics.median(rates["checkpoint"]) / statistics.median(rates["disk"])
    print(f"save throughput: checkpoint {statistics.median(rates['checkpoint']):.0f} MB/s vs disk "
          f"{statistics.median(rates['disk']):.0f} MB/s (medians, both fsynced); ratio checkpoint/disk {ratio:.2f}")
    return distcp


def part2(trainer: Trainer, root: Path, args: argparse.Namespace, ref_distcp: int) -> dict[str, dict]:
    """Rounds of `args.steps` training steps per mode, interleaved; saves every `args.every` steps of a round."""
    keep = trainer.config.checkpoint.keep_last
    managers = {
        "none": BenchManager(root / "none", trainer, async_save=False, every=0, keep_last=keep),
        "sync": BenchManager(root / "sync", trainer, async_save=False, every=args.every, keep_last=keep),
        "async": BenchManager(root / "async", trainer, async_save=True, every=args.every, keep_last=keep),
    }
    save_wall: dict[str, list[float]] = {m: [] for m in MODES}
    current = {"mode": "none"}
    real_save = trainer.save

    def timed_save(wait: bool = False):  # the loop calls self.save(...): an independent timer around it
        start = time.perf_counter()
        try:
            return real_save(wait=wait)
        finally:
            save_wall[current["mode"]].append(time.perf_counter() - start)

    trainer.save = timed_save
    # Untimed: one async save, drained, so the async side's first-call costs (its gloo group) are paid.
    trainer.checkpoints = BenchManager(root / "warmup", trainer, async_save=True, every=0, keep_last=1)
    real_save(wait=True)
    shutil.rmtree(root / "warmup")

    rows = []
    steps_s: dict[str, list[float]] = {m: [] for m in MODES}
    print()
    header = (f"{'round':>5}  {'mode':<5}  {'steps s':>7}  {'s/step':>6}  {'saves':>5}  {'blocking_s/save':>15}  "
              f"{'wall/save':>9}  {'write/save':>10}  {'drain s':>7}")
    print(header + "   (per-save columns: mean over the round)")
    print("-" * len(header))
    for r in range(args.rounds):
        order = MODES[r % 3:] + MODES[: r % 3]
        for mode in order:
            m = managers[mode]
            trainer.checkpoints = m
            current["mode"] = mode
            m.round_start = trainer.step
            n_block, n_wall, n_write, n_drain = len(m.blocking_s), len(save_wall[mode]), len(m.write_s), len(m.drain_s)
            sync_fs()
            start = time.perf_counter()
            trainer.train_steps(args.steps)
            if trainer.place.device.type == "cuda":
                torch.cuda.synchronize(trainer.place.device)
            elapsed = time.perf_counter() - start
            m.finalize()  # drain: the last async save is written and committed
            drain = sum(m.drain_s[n_drain:])
            steps_s[mode].append(elapsed)
            if mode == "async":
                check_async(m, ref_distcp)
            blk, wall, wr = m.blocking_s[n_block:], save_wall[mode][n_wall:], m.write_s[n_write:]
            mean = lambda xs: f"{statistics.fmean(xs):.3f}" if xs else "-"  # noqa: E731
            print(f"{r + 1:>5}  {mode:<5}  {elapsed:>7.2f}  {elapsed / args.steps:>6.2f}  {len(wall):>5}  "
                  f"{mean(blk):>15}  {mean(wall):>9}  {mean(wr):>10}  {drain:>7.2f}", flush=True)
            rows.append((mode, elapsed, drain))
    print("-" * len(header))
    trainer.save = real_save
    return {"managers": managers, "save_wall": save_wall, "steps_s": steps_s, "rows": rows}


def check_async(m: BenchManager, ref_distcp: int) -> None:
    """The async round's checkpoints are committed and complete; nothing half-written is left."""
    found = ckpt.list_checkpoints(m.root)
    problems = []
    if m.last is None or m.last not in found:
        problems.append(f"the last save ({m.last}) is not a complete checkpoint")
    for path in found:
        if not (path / ckpt.TRAIN_STATE).exists() or not (path / ".metadata").exists():
            problems.append(f"{path.name} lacks train_state.json or .metadata")
        elif folder_bytes(path, ".distcp") != ref_distcp:
            problems.append(f"{path.name} holds {folder_bytes(path, '.distcp')} bytes of .distcp, a sync save "
                            f"{ref_distcp}")
    leftovers = sorted(p.name for p in m.root.glob(".tmp-*"))
    if leftovers:
        problems.append(f"left-over incomplete folders: {', '.join(leftovers)}")
    if problems:
        raise SystemExit("async checkpoint check FAILED: " + "; ".join(problems))


def summarize(result: dict, args: argparse.Namespace) -> None:
    managers, save_wall, steps_s = result["managers"], result["save_wall"], result["steps_s"]
    n_steps = args.steps * args.rounds
    saves = {m: len(save_wall[m]) for m in MODES}
    med = statistics.median
    print()
    print(f"per save (median over {saves['sync']} sync, {saves['async']} async saves):")
    blocking = {}
    for mode in ("sync", "async"):
        m = managers[mode]
        blocking[mode] = (med(m.blocking_s), med(save_wall[mode]))
        waits = f", waiting for the previous save inside save() {sum(m.wait_prev_s):.2f}s in all" * bool(m.wait_prev_s)
        print(f"  {mode:<5}  manager blocking_s {blocking[mode][0]:.3f}s  wall around Trainer.save "
              f"{blocking[mode][1]:.3f}s  save->written {med(m.write_s):.3f}s{waits}")
    print(f"  async/sync blocking ratio: manager blocking_s {blocking['async'][0] / blocking['sync'][0]:.3f}, "
          f"wall {blocking['async'][1] / blocking['sync'][1]:.3f}")
    a = managers["async"]
    total = {m: sum(steps_s[m]) for m in MODES}
    drain = {m: sum(d for mode, _e, d in result["rows"] if mode == m) for m in MODES}
    print()
    print(f"training time, {n_steps} steps per mode ({args.rounds} x {args.steps}, interleaved), saves every "
          f"{args.every} steps:")
    base = total["none"] / n_steps
    for mode in MODES:
        per_step = total[mode] / n_steps
        line = f"  {mode:<5}  {total[mode]:7.2f}s  {per_step:.3f} s/step"
        if mode != "none":
            over = total[mode] - total["none"]
            line += (f"  overhead vs none {over:+.2f}s = {100 * over / total['none']:+.1f}% of step time "
                     f"({over / max(saves[mode], 1):+.3f}s per save); drain after the rounds {drain[mode]:.2f}s")
        print(line)
    spread = {m: (max(v) - min(v)) / med(v) for m, v in steps_s.items() if len(v) > 1}
    if spread and max(spread.values()) > 0.15:
        print(f"  note: round times of one mode varied by up to {100 * max(spread.values()):.0f}% (a busy machine?); "
              f"an overhead smaller than that is noise: rerun with more --rounds")
    print(f"  async checkpoints complete: {len(ckpt.list_checkpoints(a.root))} committed folders checked, last "
          f"{a.last.name if a.last else None}; checkpoint threads alive after the drain: {ckpt_threads()}")
    print()
    print(f"blocking per save: sync {blocking['sync'][1]:.3f}s, async {blocking['async'][1]:.3f}s (wall); "
          f"ratio async/sync {blocking['async'][1] / blocking['sync'][1]:.3f}")
    print(f"step-time overhead vs no saves: sync {100 * (total['sync'] / total['none'] - 1):+.1f}%, "
          f"async {100 * (total['async'] / total['none'] - 1):+.1f}% (base {base:.3f} s/step)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base_dir = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base_dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="clustertrain-ckpt-bench-", dir=base_dir)).resolve()
    overrides = [
        f"train.run_dir={root / 'run'}",
        "train.resume=none",
        "train.steps=1000000",  # never reached: the end-of-run save would otherwise fire
        "train.eval_every=0",
        "train.sample_tokens=0",
        "train.global_batch_size=2",
        "train.micro_batch_size=2",
        "checkpoint.every=0",
        "checkpoint.on_error=stop",  # a failed save must stop the benchmark, not be timed as a fast one
        "metrics.progress=none",
        "metrics.tensorboard=false",
        f"metrics.log_every={10 ** 9}",
        MODEL,
        *args.overrides,
    ]
    cfg = load_checked_config(None, overrides)
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    try:
        trainer.build()
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.start(None)
        trainer.train_steps(args.warmup)  # the optimizer state exists from here on
        model_b, optim_b = state_bytes(trainer)
        hf = trainer.model.runner.model.config
        print(f"model: {cfg.model.arch} {trainer.model.params['total'] / 1e6:.2f}M params (hidden "
              f"{getattr(hf, 'hidden_size', '?')}, {getattr(hf, 'num_hidden_layers', '?')} layers, vocab "
              f"{hf.vocab_size}); state: model {model_b / MB:.1f} MB + AdamW {optim_b / MB:.1f} MB = "
              f"{(model_b + optim_b) / MB:.1f} MB")
        print(f"batch {cfg.train.global_batch_size} x {cfg.data.seq_len} | device {trainer.place.device.type}, "
              f"{torch.get_num_threads()} threads | torch {torch.__version__} | built + {args.warmup} warmup steps "
              f"in {time.perf_counter() - t0:.1f}s")
        print(f"writing under {root} ({fs_type(root)})")

        print()
        print(f"== 1. save throughput vs the disk's sequential write speed ({args.reps} reps, alternating)")
        ref_distcp = part1(trainer, root, args)  # a sync save's .distcp bytes: the async check compares with it
        shutil.rmtree(root / "throughput")

        print()
        print(f"== 2. training-blocking time of sync vs async saves ({args.rounds} rounds x {args.steps} steps per "
              f"mode, save every {args.every}, modes interleaved)")
        summarize(part2(trainer, root, args, ref_distcp), args)
        leftovers = sorted(str(p.relative_to(root)) for p in root.rglob(".tmp-*"))
        if leftovers:
            print(f"warning: incomplete checkpoint folders left over: {', '.join(leftovers)}")
    finally:
        trainer.close()
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
