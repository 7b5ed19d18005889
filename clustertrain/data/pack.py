"""Documents -> fixed-length training sequences, with a cursor small enough to checkpoint.

A `DocumentOrder` walks one stream's slice of a source, shuffled within windows of `shuffle_buffer`
documents and reshuffled every epoch (epoch_order.py; with `data.reshuffle_on_resume`, anew over the rest of the
epoch at each resume); a `Cursor` walks one or several orders (a rows-weighted mixture); a `Packer` turns the
documents under a cursor into sequences. Every position is a few integers, and restoring one re-reads and
re-tokenizes at most one window: never the data before it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from clustertrain.data.holdout import SplitSource
from clustertrain.data.epoch_order import EpochOrder
from clustertrain.data.mixture import choose
from clustertrain.data.sources import Document
from clustertrain.errors import DataError

IGNORE_INDEX = -100


@dataclass
class Encoded:
    """One tokenized document: ids, and which ids carry loss (None: all of them)."""

    ids: list[int] | np.ndarray  # an int32 array for a long document (plan.encode_long)
    loss_mask: list[bool] | None = None


Encoder = Callable[[list[Document]], list[Encoded | None]]  # None: a bad record, skipped


class DocumentOrder:
    """The documents at positions [lo, hi) of `source` (one side of its held-out split: position p is document
    `source.index(p)`) in this stream's order (rotated by `rotate`, and starting `phase` into the first document,
    when streams share the slice)."""

    def __init__(self, source: SplitSource, lo: int, hi: int, rotate: int, buffer: int, key: tuple[int, ...],
                 encode: Encoder, phase: float = 0.0):
        if hi <= lo:
            raise DataError(f"data source {source.label!r} has no documents to read")
        self.source, self.lo, self.length, self.rotate = source, lo, hi - lo, rotate
        self.phase = phase  # where in its first document a stream sharing the slice starts, as a fraction
        self.buffer, self.key, self.encode = buffer, key, encode
        self._window: tuple[int, dict[int, Encoded | None]] | None = None
        self._epoch: tuple[tuple, EpochOrder] | None = None  # ((epoch, seed, reshuffles), its order)

    def at(self, epoch: int, pos: int, seed: int | None = None,
           reshuffles: list[list[int]] | tuple = ()) -> tuple[int, Encoded | None]:
        """(document index, its encoding or None if skipped) at position `pos` of `epoch`, whose order `seed`
        (default: this order's key's) and `reshuffles` ([position, seed] pairs: epoch_order.py) give."""
        which = (epoch, self.key[0] if seed is None else seed, tuple(map(tuple, reshuffles)))
        if self._epoch is None or self._epoch[0] != which:
            self._epoch = (which, EpochOrder(self.length, self.buffer, self.key, *which))
        window, within = self._epoch[1].locate(pos)
        size = min(self.buffer, self.length - window * self.buffer)
        index = self.source.index(self.lo + (window * self.buffer + within + self.rotate) % self.length)
        return index, self._load(window, size)[index]

    def _load(self, window: int, size: int) -> dict[int, Encoded | None]:
        if self._window is None or self._window[0] != window:
            start = (window * self.buffer + self.rotate) % self.length
            pieces = [(start, min(start + size, self.length)), (0, max(0, start + size - self.length))]
            docs = [d for a, b in pieces if b > a for d in self.source.read(self.lo + a, self.lo + b)]
            encoded = dict.fromkeys(
                (self.source.index(self.lo + (start + j) % self.length) for j in range(size)), None
            )  # records the source skipped stay None
            encoded.update(zip((d.index for d in docs), self.encode(docs)))
            self._window = (window, encoded)
        return self._window[1]


class Cursor:
    """Walks documents from one order, or from several chosen per document by weight (mix_by: rows)."""

    def __init__(self, orders: list[DocumentOrder], weights: tuple[float, ...], key: tuple[int, ...]):
        self.orders, self.weights, self.key = orders, weights, key
        self.count = 0
        # per order [epoch, pos], and once a resume has reshuffled it [epoch, pos, the epoch's seed, reshuffles]
        self.positions: list[list] = [[0, 0] for _ in orders]

    def current(self) -> tuple[int, int, Encoded | None]:
        """(source slot, document index, encoding) under the cursor."""
        slot = choose(self.weights, *self.key, self.count)
        return (slot, *self.orders[slot].at(*self.positions[slot]))

    def current_epoch(self) -> int:
        return self.positions[choose(self.weights, *self.key, self.count)][0]

    def documents(self) -> int:
        """How many documents this cursor can reach."""
        return sum(order.length for order, weight in zip(self.orders, self.weights) if weight > 0)

    def advance(self) -> None:
        slot = choose(self.weights, *self.key, self.count)
        position = self.positions[slot]
        position[1] += 1
        if position[1] == self.orders[slot].length:
            position[0], position[1] = position[0] + 1, 0
            if len(position) > 2:  # the next epoch is drawn under the latest seed, from its start
                position[2:] = [position[3][-1][1] if position[3] else position[2], []]
        self.count += 1

    def reshuffle(self, seed: int, started: bool) -> None:
        """Draw a new order, under `seed`, over each order's documents not yet read in its epoch; `started`: the
        document under the cursor is partly read, so it stays where it is."""
        current = choose(self.weights, *self.key, self.count)
        for slot, (order, position) in enumerate(zip(self.orders, self.positions)):
            if self.weights[slot] == 0:  # a lane's other sources (mix_by: tokens), never read here
                continue
            if len(position) == 2:
                position += [order.key[0], []]
            position[3].append([position[1] + (started and slot == current), seed])

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "positions": [[*p[:3], [list(r) for r in p[3]]] if len(p) > 2 else list(p)
                                                   for p in self.positions]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]
        self.positions = [[*p[:3], [list(r) for r in p[3]]] if len(p) > 2 else list(p) for p in state["positions"]]


@dataclass
class Sequence:
    """One training row: `input_ids`, `labels`, `position_ids` (numpy, length seq_len), and where it came from."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    origin: tuple[int, int, int, int]  # (source slot, document, token offset, epoch) of its first token
    tokens_by_slot: Counter


def document_bounds(position_ids: np.ndarray) -> np.ndarray:
    """Where the documents of packed rows start, as flash-attn's varlen kernel takes them (`cu_seq_lens`): the rows
    laid end to end, a document starting at each row's start and wherever a position does not follow the one
    before it; int32, ending with the total length.

    Found here, on the host, so that the GPU never has to report how many documents a batch holds.
    """
    rows, length = position_ids.shape
    starts = np.ones((rows, length), dtype=bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return np.append(np.flatnonzero(starts), rows * length).astype(np.int32)


class Packer:
    """Pretraining: documents (each ending in EOS) concatenated and cut into windows of seq_len + 1 tokens.

    SFT (`whole_examples=True`): examples are never split; an example that does not fit starts the next
    sequence, the rest is padding with no loss, and position ids restart per example so attention (with
    HF's packed-sequence masking) never crosses examples.
    """

    def __init__(self, cursor: Cursor, seq_len: int, pad_id: int, whole_examples: bool, on_bad_data: str,
                 labels: list[str]):  # labels: each source as messages name it, e.g. "'a' (data/a.jsonl)"
        self.cursor, self.seq_len, self.pad_id = cursor, seq_len, pad_id
        self.whole_examples, self.on_bad_data, self.labels = whole_examples, on_bad_data, labels
        self.offset = 0  # tokens of the current document already used
        self.skipped: Counter = Counter()

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor.state_dict(), "offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor.load_state_dict(state["cursor"])
        self.offset = state["offset"]

    def reshuffle(self, seed: int) -> None:
        """A new order over the documents not yet read this epoch (the one partly packed finishes first)."""
        self.cursor.reshuffle(seed, started=self.offset > 0)

    def next(self) -> Sequence:
        return self._next_example_pack() if self.whole_examples else self._next_window()

    def _current(self) -> tuple[int, int, Encoded]:
        bad = 0  # records skipped as bad (on_bad_data: skip), the others of the pass being empty
        for _ in range(self.cursor.documents() + 1):  # a whole pass over every document, and one more
            slot, index, encoded = self.cursor.current()
            if encoded is not None and len(encoded.ids) > 1:
                return slot, index, encoded
            self.skipped["empty or bad record"] += 1
            bad += encoded is None
            self.cursor.advance()
        documents = self.cursor.documents()
        what = f"data source {self.labels[slot]}: every one of the {documents:,} documents this stream reads"
        if not bad:  # always so under on_bad_data: error, where a bad record stops the run as it is read
            raise DataError(f"{what} is empty (no text), so there is nothing to train on; give the source documents "
                            "with text")
        raise DataError(f"{what} was skipped as bad or empty (data.on_bad_data: skip), so there is nothing to train "
                        "on; set data.on_bad_data: error to see the first bad one")

    def _next_window(self) -> Sequence:
        need, have = self.seq_len + 1, 0
        pieces: list[np.ndarray] = []  # arrays, not lists of Python ints: 8 bytes a token, however long seq_len
        tokens: Counter = Counter()
        origin = None
        while have < need:
            slot, index, encoded = self._current()
            if self.cursor.count == 0 and self.offset == 0:  # the stream's first window
                self.offset = int((len(encoded.ids) - 1) * self.cursor.orders[slot].phase)
            if origin is None:
                origin = (slot, index, self.offset, self.cursor.current_epoch())
            take = np.asarray(encoded.ids[self.offset : self.offset + need - have], dtype=np.int64)
            pieces.append(take)
            have += len(take)
            tokens[slot] += len(take)
            self.offset += len(take)
            if self.offset >= len(encoded.ids):
                self.cursor.advance()
                self.offset = 0
        window = np.concatenate(pieces)
        positions = np.concatenate([np.arange(len(piece), dtype=np.int64) for piece in pieces])
        return Sequence(window[:-1], window[1:].copy(), positions[:-1], origin, tokens)

    def _next_example_pack(self) -> Sequence:
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        tokens: Counter = Counter()
        origin = None
        too_long = 0  # skipped in a row: more than a whole pass means no example of this stream fits
        while True:
            slot, index, encoded = self._current()
            length = len(encoded.ids) - 1
            if length > self.seq_len:
                too_long += 1
                self._too_long(slot, index, length, too_long > self.cursor.documents())
                continue
            too_long = 0
            if len(ids) + length > self.seq_len:
                break
            if origin is None:
                origin = (slot, index, 0, self.cursor.current_epoch())
            mask = encoded.loss_mask or [True] * len(encoded.ids)
            ids.extend(encoded.ids[:-1])
            labels.extend(t if m else IGNORE_INDEX for t, m in zip(encoded.ids[1:], mask[1:]))
            positions.extend(range(length))
            tokens[slot] += length
            self.cursor.advance()
        pad = self.seq_len - len(ids)
        ids.extend([self.pad_id] * pad)
        labels.extend([IGNORE_INDEX] * pad)
        positions.extend(range(pad))
        as_array = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
        return Sequence(as_array(ids), as_array(labels), as_array(positions), origin, tokens)

    def _too_long(self, slot: int, index: int, length: int, every: bool) -> None:
        """Skip (on_bad_data: skip) or refuse an example longer than a row; `every`: a whole pass of the stream
        found none that fits, so skipping on would never end."""
        if self.on_bad_data == "error":
            raise DataError(
                f"data source {self.labels[slot]} document {index}: {length + 1} tokens do not fit data.seq_len = "
                f"{self.seq_len}; raise data.seq_len, or set data.on_bad_data: skip"
            )
        if every:
            raise DataError(
                f"data source {self.labels[slot]}: none of the {self.cursor.documents():,} examples this stream "
                f"reads fits data.seq_len = {self.seq_len} (each was skipped, data.on_bad_data: skip), so there is "
                "nothing to train on; raise data.seq_len"
            )
        self.skipped["longer than seq_len"] += 1
        self.cursor.advance()
