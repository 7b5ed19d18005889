"""Global batches from K logical streams, dealt to data-parallel ranks; a position that moves between rank counts.

Row j of every global batch comes from stream j (K = train.global_batch_size streams). Each stream is an
independent, deterministic pipeline over its own slice of every source (see pack.py), so the sequence of
global batches depends only on the config and the seed. Data-parallel rank r serves the contiguous block
of streams [r*K/dp, (r+1)*K/dp). The saved position is every stream's cursor, a few integers each: on
resume, any data-parallel degree that divides K picks up its streams' cursors and continues exactly.

On a GPU rank a batch's tensors are in pinned (page-locked) host memory, so that the copy to the GPU is
asynchronous: from pageable memory CUDA copies synchronously, even when asked for `non_blocking`.
"""

from __future__ import annotations

import os
from collections import Counter, deque
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from clustertrain.config.layout import rows_problem
from clustertrain.data.pack import document_bounds
from clustertrain.data.mixture import derive_seed
from clustertrain.data.plan import SEED, DataPlan, spec_changes
from clustertrain.distributed.collectives import all_gather_objects, rank_device
from clustertrain.distributed.spawn import die_with_parent
from clustertrain.errors import ConfigError, DataError, UserError


class _RankStreams(IterableDataset):
    """Yields (stream id, sequence tensors, stream state after it, skip counts) round-robin over streams."""

    def __init__(self, plan: DataPlan, stream_ids: list[int], states: dict[int, Any], split: str):
        self.plan, self.stream_ids, self.states, self.split = plan, stream_ids, states, split

    def __iter__(self) -> Iterator[tuple | UserError]:
        worker = get_worker_info()
        mine = self.stream_ids if worker is None else self.stream_ids[worker.id :: worker.num_workers]
        try:
            streams = {s: self.plan.stream(s, self.split, self.states.get(s)) for s in mine}
            while True:
                for s in mine:
                    seq = streams[s].next()
                    yield s, seq, streams[s].state_dict(), streams[s].take_skipped()
        except UserError as e:  # handed over as an item: torch would re-raise it wrapped in the worker's traceback
            yield e


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in pinned host memory (torch has a pinned allocator only where it sees a GPU)."""
    return tensor.pin_memory()


class StreamLoader:
    """This rank's share of each global batch, and the global position (same on every rank once gathered).

    `pin_memory`: hand out batches in pinned host memory; None: when this rank's device is a GPU.
    """

    def __init__(self, plan: DataPlan, dp_rank: int, dp_size: int, num_workers: int = 0, split: str = "train",
                 pin_memory: bool | None = None):
        self.plan, self.split, self.num_workers = plan, split, num_workers
        self.pin_memory = rank_device().type == "cuda" if pin_memory is None else pin_memory
        self.num_streams = plan.num_streams  # one stream per row of the global batch
        problem = rows_problem(self.num_streams, dp_size)  # checked at start too; callers here get the same line
        if problem:  # before the streams exist: each keeps a reader and a window of documents
            raise ConfigError(problem)
        per_rank = self.num_streams // dp_size
        self.stream_ids = list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank))
        self.states: dict[int, Any] = {}
        self.batches = 0
        self.skipped: Counter = Counter()
        self._iterator: Iterator | None = None
        self._queues: dict[int, deque] = {s: deque() for s in self.stream_ids}
        self._ahead: dict[str, Any] | None = None  # a batch read by prefetch(), for the next next_batch()

    # ---- position ------------------------------------------------------------------------------
    def local_state(self) -> dict[str, Any]:
        return {"batches": self.batches, "streams": {s: self.states.get(s) for s in self.stream_ids}}

    def state_dict(self) -> dict[str, Any]:
        """The global position: every rank's stream cursors (a collective when distributed)."""
        parts = [self.local_state()]
        if dist.is_initialized() and dist.get_world_size() > 1:
            parts = all_gather_objects(self.local_state())
        return self.global_state(parts)

    def global_state(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        """Merge the local states of all data-parallel ranks into the global position."""
        streams: dict[int, Any] = {}
        for part in parts:
            streams.update(part["streams"])
        return {
            "batches": self.batches,
            "num_streams": self.num_streams,
            "fingerprint": self.plan.fingerprint(),
            "data_spec": self.plan.spec(),  # what changed, should a resume be refused
            "streams": [streams.get(s) for s in range(self.num_streams)],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a global position saved on any number of ranks."""
        if state.get("num_streams") != self.num_streams:
            raise DataError(
                f"the checkpoint's data position has {state.get('num_streams')} streams (its "
                f"train.global_batch_size), this run has {self.num_streams}: keep train.global_batch_size to resume"
            )
        reshuffle = self.plan.data.reshuffle_on_resume
        if state.get("fingerprint") != self.plan.fingerprint():
            changes = spec_changes(state["data_spec"], self.plan.spec()) if "data_spec" in state else []
            others = [change for change in changes if not change.startswith(SEED + ":")]
            seed_changed = len(others) < len(changes)
            if reshuffle:  # a new seed is welcome: the position's draws keep the old one (Stream.state_dict)
                changes = others
            if not (reshuffle and seed_changed and not others):
                raise DataError(
                    "the checkpoint's data position was taken over other data: "
                    + (f"{'; '.join(changes)}; restore {'it' if len(changes) == 1 else 'them'} to resume" if changes
                       else "data.sources, data.seq_len, data.seed, data.mode, data.mix_by or data.shuffle_buffer "
                       "changed; restore them to resume")
                    + (" (or set data.reshuffle_on_resume: true to read the epoch's unread documents in a new order)"
                       if seed_changed and not reshuffle else "")
                )
        self.batches = state["batches"]
        self.states = {s: state["streams"][s] for s in self.stream_ids}
        if reshuffle:
            self._reshuffle(state.get("data_spec", {}).get(SEED, self.plan.seed))
        self._iterator = self._ahead = None

    def _reshuffle(self, first_seed: int) -> None:
        """data.reshuffle_on_resume: this rank's streams read the documents not yet read in their epochs in a new
        order, under a seed of this data.seed and this position (every rank draws the same; a resume from the same
        checkpoint draws it again). `first_seed`: the seed of a saved stream that does not name its own."""
        seed = derive_seed(self.plan.seed, self.batches)
        for s, state in self.states.items():
            if state is not None:  # None: a stream not yet read, whose whole epoch is still ahead
                stream = self.plan.stream(s, self.split, {"seed": first_seed, **state})
                stream.reshuffle(seed)
                self.states[s] = stream.state_dict()

    # ---- batches -------------------------------------------------------------------------------
    def next_batch(self) -> dict[str, Any]:
        """This rank's rows of the next global batch: tensors `input_ids`, `labels`, `position_ids`
        ([rows, seq_len]) and `cu_seq_lens` (where the documents packed into the rows start, laid end to end:
        `clustertrain.data.pack.document_bounds`), plus `origins` (per-row fingerprints) and `tokens_by_source`
        (a Counter)."""
        if self._ahead is not None:
            batch, self._ahead = self._ahead, None
            return batch
        if self._iterator is None:
            self._iterator = self._start()
            self._queues = {s: deque() for s in self.stream_ids}
        while any(not q for q in self._queues.values()):
            item = next(self._iterator)
            if isinstance(item, UserError):
                raise item
            s, seq, state, skipped = item
            self._queues[s].append((seq, state, skipped))
        rows, origins, tokens = [], [], Counter()
        for s in self.stream_ids:
            seq, state, skipped = self._queues[s].popleft()
            rows.append(seq)
            origins.append((s, *seq.origin))
            tokens.update({self.plan.labels[slot]: n for slot, n in seq.tokens_by_slot.items()})
            self.states[s] = state
            self.skipped.update(skipped)
        self.batches += 1
        arrays = {name: np.stack([getattr(r, name) for r in rows]) for name in ("input_ids", "labels", "position_ids")}
        arrays["cu_seq_lens"] = document_bounds(arrays["position_ids"])
        tensors = {name: torch.from_numpy(array) for name, array in arrays.items()}
        if self.pin_memory:
            tensors = {name: pinned(tensor) for name, tensor in tensors.items()}
        return {**tensors, "origins": origins, "tokens_by_source": tokens}

    def prefetch(self) -> None:
        """Read the next batch now, so that a bad or missing record in it fails before anything slow or anything
        on disk happens; the next `next_batch` returns it. Take no `state_dict` in between."""
        self._ahead = self.next_batch()

    def _start(self) -> Iterator:
        dataset = _RankStreams(self.plan, self.stream_ids, dict(self.states), self.split)
        if self.num_workers == 0:
            return iter(dataset)
        workers = min(self.num_workers, len(self.stream_ids))
        ahead = 2 * len(self.stream_ids) // workers  # items are single rows: keep about two batches in flight
        # A worker dies with its rank, however the rank ends (SIGKILL, os._exit): none lives on, orphaned.
        return iter(DataLoader(dataset, batch_size=None, num_workers=workers, prefetch_factor=max(2, ahead),
                               collate_fn=lambda item: item, worker_init_fn=partial(die_with_parent, os.getpid())))
