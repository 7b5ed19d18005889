"""The resume audit: every global batch's sample fingerprints in samples.jsonl, and a report over them.

A fingerprint is (source, document, token offset, epoch) of a row's first token: it names the sample. A
run appends one line per global batch, across resumes; a step written twice (a killed run re-does the
steps after its last checkpoint) counts once, the later record winning. The first line of each start of a run
says so ("start": true), so that the replay knows where a resume drew a new order (data.reshuffle_on_resume).
The report replays the data order from the run's config and lists samples the run repeated or skipped.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch.distributed as dist

from clustertrain.distributed.collectives import gather_objects


class AuditLog:
    """Appends the global batch's fingerprints (gathered from every rank) to `path` on rank 0.

    Ranks that differ only in their tensor- or pipeline-parallel place read the same rows: the rows of each
    data-parallel rank (`dp_rank`, from the mesh) count once.
    """

    def __init__(self, path: Path, labels: list[str], dp_rank: int = 0):
        self.path, self.labels, self.dp_rank = path, labels, dp_rank
        self._file = None
        self._started = False  # the first record of this start is marked

    def record(self, step: int, origins: list[tuple]) -> None:
        """Every rank calls this with its rows' origins (stream, slot, document, offset, epoch)."""
        parts = [(self.dp_rank, origins)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            parts = gather_objects(parts[0])
            if parts is None:
                return
        by_dp_rank = dict(parts)  # tp and pp peers hand in the same rows: one copy each
        rows = sorted(row for part in by_dp_rank.values() for row in part)
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")
        first = {} if self._started else {"start": True}  # where a resume may have drawn a new order
        self._started = True
        samples = [[self.labels[slot], doc, offset, epoch] for _, slot, doc, offset, epoch in rows]
        self._file.write(json.dumps({"step": step, "samples": samples, **first}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_audit(path: Path) -> dict[int, list[tuple]]:
    """step -> fingerprints, the later record of a step winning."""
    steps: dict[int, list[tuple]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            steps[record["step"]] = [tuple(s) for s in record["samples"]]
    return steps


def read_starts(path: Path) -> list[int]:
    """The first steps of the starts that the recorded steps come from: a start at step s replaces the starts
    after it (a run resumed from an earlier checkpoint re-does their steps)."""
    starts: list[int] = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("start"):
            starts = [s for s in starts if s < record["step"]] + [record["step"]]
    return starts


def audit_report(recorded: dict[int, list[tuple]], expected: dict[int, list[tuple]] | None) -> dict[str, Any]:
    """Repeated samples (within one epoch), skipped and unexpected ones against the replayed order, mixture."""
    seen = Counter(s for samples in recorded.values() for s in samples)
    report: dict[str, Any] = {
        "steps": len(recorded),
        "samples": sum(seen.values()),
        "repeated": sorted(s for s, n in seen.items() if n > 1),
        "missing_steps": sorted(set(range(1, max(recorded, default=0) + 1)) - set(recorded)),
    }
    sources = Counter(s[0] for samples in recorded.values() for s in samples)
    report["proportions"] = {k: v / max(1, sum(sources.values())) for k, v in sorted(sources.items())}
    if expected is not None:
        want = Counter(s for step, samples in expected.items() if step in recorded for s in samples)
        report["skipped"] = sorted((want - seen).elements())
        report["unexpected"] = sorted((seen - want).elements())
    return report


def problem_lines(report: dict[str, Any], recorded: dict[int, list[tuple]],
                  expected: dict[int, list[tuple]] | None, limit: int = 20) -> list[str]:
    """The problems of `report` for people: the missing steps, then a line per repeated, skipped or unexpected
    sample (at most `limit` of each kind) naming it and the steps it was recorded at, or was due at."""
    lines = []
    if report["missing_steps"]:
        lines.append("missing steps: " + ", ".join(map(str, report["missing_steps"])))
    kinds = [("repeated", report["repeated"], recorded, "recorded at"),
             ("skipped", report.get("skipped", []), expected or {}, "due at"),
             ("unexpected", report.get("unexpected", []), recorded, "recorded at")]
    for kind, samples, steps, where in kinds:
        steps_of = defaultdict(list)
        for step, step_samples in sorted(steps.items()):
            for sample in step_samples:
                steps_of[sample].append(step)
        distinct = sorted(set(samples))
        for sample in distinct[:limit]:
            source, document, offset, epoch = sample
            at = steps_of[sample]
            lines.append(f"{kind}: {source} document {document} at token {offset} (epoch {epoch}), {where} "
                         f"step{'s' if len(at) > 1 else ''} {', '.join(map(str, at))}")
        if len(distinct) > limit:
            lines.append(f"{kind}: {len(distinct) - limit} more (--json lists them all)")
    return lines


def expected_samples(config, steps: int, starts: list[int] = ()) -> dict[int, list[tuple]]:
    """Replay the data order of `config` on one process: step -> fingerprints of steps 1..`steps`. Under
    data.reshuffle_on_resume, the position is saved and loaded again before each step of `starts` (read_starts),
    so the replay draws the new orders the run's resumes drew."""
    from clustertrain.data.loader import StreamLoader
    from clustertrain.data.plan import DataPlan
    from clustertrain.data.tokenize import cache_root, load_tokenizer

    data = config.data
    seed = config.data_seed
    plan = DataPlan(data, load_tokenizer(data), config.train.global_batch_size, seed, cache_root(data))
    loader = StreamLoader(plan, dp_rank=0, dp_size=1)
    expected = {}
    for step in range(1, steps + 1):
        if step in starts and step > 1 and data.reshuffle_on_resume:
            loader.load_state_dict(loader.state_dict())
        origins = sorted(loader.next_batch()["origins"])
        expected[step] = [(plan.labels[slot], doc, offset, epoch) for _, slot, doc, offset, epoch in origins]
    return expected
