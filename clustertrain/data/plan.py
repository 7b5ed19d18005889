"""What a data config means: opened sources, their held-out splits, encoders, and the streams over them."""

from __future__ import annotations

import hashlib
import json
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from clustertrain.config.data_schema import DataConfig, SourceConfig
from clustertrain.data.holdout import HeldOut, SplitSource
from clustertrain.data.mixture import choose
from clustertrain.data.pack import Cursor, DocumentOrder, Encoded, Packer, Sequence
from clustertrain.data.sources import Document, open_source, text_of
from clustertrain.data.tokens import TokenSource, is_token_source
from clustertrain.errors import DataError


class Stream:
    """One logical stream: a packer per lane, and a weighted choice of lane per sequence (mix_by: tokens)."""

    def __init__(self, packers: list[Packer], weights: tuple[float, ...], key: tuple[int, ...]):
        self.packers, self.weights, self.key = packers, weights, key
        self.count = 0

    def next(self) -> Sequence:
        lane = choose(self.weights, *self.key, self.count)
        self.count += 1
        return self.packers[lane].next()

    def take_skipped(self) -> Counter:
        skipped = Counter()
        for packer in self.packers:
            skipped.update(packer.skipped)
            packer.skipped.clear()
        return skipped

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "lanes": [p.state_dict() for p in self.packers], "seed": self.key[0]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]
        for packer, lane in zip(self.packers, state["lanes"]):
            packer.load_state_dict(lane)

    def reshuffle(self, seed: int) -> None:
        """A new order, under `seed`, over every lane's documents not yet read in their epochs."""
        for packer in self.packers:
            packer.reshuffle(seed)


class RandomStream:
    """Uniform random token ids (data.mode: random), for checking a cluster before real data is ready."""

    def __init__(self, vocab_size: int, seq_len: int, key: tuple[int, ...]):
        self.vocab_size, self.seq_len, self.key = vocab_size, seq_len, key
        self.count = 0

    def next(self) -> Sequence:
        ids = np.random.default_rng([*self.key, self.count]).integers(0, self.vocab_size, self.seq_len + 1)
        origin = (0, self.count, 0, 0)
        self.count += 1
        return Sequence(ids[:-1], ids[1:], np.arange(self.seq_len), origin, Counter({0: self.seq_len}))

    def take_skipped(self) -> Counter:
        return Counter()

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "seed": self.key[0]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]

    def reshuffle(self, seed: int) -> None:
        """Nothing to reshuffle: the ids are drawn, not read."""


EVAL_FRACTION = "data.eval_fraction (0 with data.eval_sources)"  # keys of DataPlan.spec
SEED = "data.seed (train.seed if unset)"
EVAL_SPLIT = "data.eval_split"


def spec_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """"KEY: OLD -> NEW" for each value of a data spec (DataPlan.spec) that differs; equal-length lists item by item."""
    saved, current = dict(saved), dict(current)
    for spec in (saved, current):  # a spec that holds documents out without data.eval_split holds out the tail
        if spec.get(EVAL_FRACTION, 0) > 0:
            spec.setdefault(EVAL_SPLIT, "tail")
    if EVAL_SPLIT not in saved or EVAL_SPLIT not in current:  # nothing held out on one side: no split to compare
        saved.pop(EVAL_SPLIT, None)
        current.pop(EVAL_SPLIT, None)
    return _changes(saved, current)


def _changes(saved: Any, current: Any, key: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(current, dict):
        return [change for k in dict.fromkeys([*saved, *current])
                for change in _changes(saved.get(k, _UNSET), current.get(k, _UNSET), f"{key}.{k}" if key else k)]
    if isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current):
        return [change for i, (old, new) in enumerate(zip(saved, current))
                for change in _changes(old, new, f"{key}[{i}]")]
    return [] if saved == current else [f"{key}: {_shown(saved)} -> {_shown(current)}"]


_UNSET = object()


def _shown(value: Any) -> str:
    text = "unset" if value is _UNSET else json.dumps(value)
    return text if len(text) <= 120 else text[:117] + "..."


PIECE_CHARS = 1 << 18  # a longer document is tokenized in pieces of about this many characters
LONG_KEPT = 4  # long documents whose encodings a process keeps for the other streams that read them


def text_pieces(text: str, size: int = PIECE_CHARS) -> list[str]:
    """`text` cut into pieces of at most `size` characters: after a line break, else before a space, where the
    next character starts a word. Byte-level BPE's pre-tokenizer splits there anyway, so the pieces' tokens
    are the whole text's."""
    pieces, start = [], 0
    while len(text) - start > size:
        end = start + size
        cut = _last_before_word(text, "\n", start + size // 2, end) + 1
        if cut == 0:
            cut = _last_before_word(text, " ", start + size // 2, end)
        cut = cut if cut > start else end
        pieces.append(text[start:cut])
        start = cut
    return [*pieces, text[start:]]


def _last_before_word(text: str, char: str, lo: int, hi: int) -> int:
    """The last index in [lo, hi) of `char` followed by a non-space, or -1."""
    at = hi
    while (at := text.rfind(char, lo, at)) >= 0:
        if not text[at + 1 : at + 2].isspace():
            return at
    return -1


def encode_long(tokenizer, text: str, eos: int) -> np.ndarray:
    """A long document's ids (and `eos`) as one int32 array: tokenized piece by piece, so the tokenizer never
    holds the whole document's encoding (offsets and all), and 4 bytes a token rather than a Python int's 28+8."""
    parts = [np.asarray(tokenizer(piece, add_special_tokens=False, return_attention_mask=False)["input_ids"],
                        dtype=np.int32) for piece in text_pieces(text)]
    return np.concatenate([*parts, np.asarray([eos], dtype=np.int32)])


class DataPlan:
    """Sources opened once per process; `stream(s, split)` builds stream s of `num_streams` from them."""

    def __init__(self, data: DataConfig, tokenizer, num_streams: int, seed: int, cache_dir: Path):
        self.data, self.tokenizer, self.num_streams, self.seed = data, tokenizer, num_streams, seed
        self.labels = [s.label for s in data.sources] if data.mode != "random" else ["random"]
        where = [s.path or s.hf_name for s in data.sources]
        self.names = [f"{s.label!r} ({w})" if w else repr(s.label) for s, w in zip(data.sources, where)]  # in messages
        self.weights = tuple(s.weight for s in data.sources)
        self.sources = [] if data.mode == "random" else [self._open(s, cache_dir) for s in data.sources]
        self.eval_fraction = 0.0 if data.eval_sources else data.eval_fraction
        splits = [HeldOut(len(src), self.eval_fraction, data.eval_split) for src in self.sources]
        self.splits = [{side: SplitSource(src, split, side) for side in ("train", "eval")}
                       for src, split in zip(self.sources, splits)]  # source -> side -> its documents
        held_out = {"sources": data.eval_sources, "eval_sources": None, "eval_fraction": 0.0}  # read whole
        self.eval_plan = DataPlan(data.model_copy(update=held_out), tokenizer, num_streams, seed,
                                  cache_dir) if data.eval_sources else None
        self.notes = self._notes()  # said once at start
        self._long: OrderedDict[tuple[int, int], Encoded] = OrderedDict()  # (source, document) -> its encoding

    def _open(self, source: SourceConfig, cache_dir: Path):
        if is_token_source(source):
            vocab = len(self.tokenizer) if self.tokenizer is not None else self.data.vocab_size
            return TokenSource(source, self.data.seq_len, vocab_size=vocab)
        return open_source(source, on_bad_data=self.data.on_bad_data, cache_dir=cache_dir)

    def _notes(self) -> list[str]:
        """What a user should know of sources too small for the batch or for a held-out split."""
        notes, k = [], self.num_streams
        for name, sides in zip(self.names, self.splits):
            n = len(sides["train"])
            if n < k and self.data.mode == "sft":
                notes.append(f"data source {name}: {n} training example(s) for the {k} rows of a global batch, so "
                             "rows repeat examples; more examples give more variety")
            elif n < k:
                how = " (a .txt corpus of one document per line: set text_unit: line)" if n == 1 else ""
                notes.append(f"data source {name}: {n} training document(s) for the {k} rows of a global batch: each "
                             f"row starts at another point of them, so no two rows are the same{how}")
            if self.eval_fraction > 0 and not sides["eval"]:
                notes.append(f"data source {name}: one document is too few to hold out data.eval_fraction = "
                             f"{self.data.eval_fraction} of it, so there is no evaluation; split it into more documents")
        return notes

    def spec(self) -> dict[str, Any]:
        """What the data position depends on, by the keys a user sets (as JSON): resuming over other data is refused."""
        d = self.data
        spec = {"data.sources": [s.model_dump() for s in d.sources], "data.mode": d.mode, "data.mix_by": d.mix_by,
                "data.seq_len": d.seq_len, "data.shuffle_buffer": d.shuffle_buffer,
                SEED: self.seed,
                EVAL_FRACTION: self.eval_fraction, "documents in data.sources": [len(s) for s in self.sources]}
        if self.eval_fraction > 0 and d.eval_split != "tail":  # without it, a position saved before it stays valid
            spec[EVAL_SPLIT] = d.eval_split
        return json.loads(json.dumps(spec, default=str))

    def fingerprint(self) -> str:
        """A hash of spec(): its values, hashed as by checkpoints that hold no spec."""
        return hashlib.sha256(json.dumps(list(self.spec().values()), sort_keys=True).encode()).hexdigest()[:16]

    def has_eval(self) -> bool:
        if self.eval_plan is not None:
            return True
        return self.data.mode == "random" or all(sides["eval"] for sides in self.splits)

    def for_split(self, split: str) -> tuple[DataPlan, str]:
        """The plan and its split that `split` reads: data.eval_sources, whole, for "eval" when they are set."""
        return (self.eval_plan, "train") if split == "eval" and self.eval_plan is not None else (self, split)

    def stream(self, s: int, split: str, state: dict[str, Any] | None = None):
        """Stream `s` over the `split` ("train" or "eval") slice of every source, at `state` if given (its draws
        keep the seed the stream began with: data.reshuffle_on_resume accepts a changed data.seed)."""
        key = ((state or {}).get("seed", self.seed), s, 0 if split == "train" else 1)
        if self.data.mode == "random":
            stream = RandomStream(len(self.tokenizer) if self.tokenizer else self.data.vocab_size, self.data.seq_len, key)
        else:
            buffer = self.data.shuffle_buffer if split == "train" else 1
            orders = [self._order(i, s, split, buffer, key) for i in range(len(self.sources))]
            sft = self.data.mode == "sft"
            make = lambda os, ws: Packer(  # noqa: E731
                Cursor(os, ws, (*key, 7)), self.data.seq_len, self._pad_id(), sft, self.data.on_bad_data, self.names
            )
            if self.data.mix_by == "rows" or len(orders) == 1:
                stream = Stream([make(orders, self.weights)], (1.0,), key)
            else:  # each lane's cursor sees only its own source: weight 1 at its slot, 0 elsewhere
                one_hot = [tuple(float(i == j) for j in range(len(orders))) for i in range(len(orders))]
                stream = Stream([make(orders, w) for w in one_hot], self.weights, key)
        if state is not None:
            stream.load_state_dict(state)
        return stream

    def sequences_per_epoch(self, streams: list[int]) -> int:
        """The fewest training sequences any of `streams` gets from one pass over its documents of every source
        (a mixture's sources counted by their documents, not their weights): the steps of one epoch. Tokenizes
        each stream's documents once."""
        if self.data.mode == "random":
            raise DataError("train.epochs counts passes over data.sources; data.mode: random has none (set train.steps)")
        return min(sum(self._pass_length(i, s) for i in range(len(self.sources))) for s in streams)

    def _pass_length(self, i: int, s: int) -> int:
        """Sequences that stream `s` makes of its documents of source `i` before it starts on them again."""
        key = (self.seed, s, 0)
        order = self._order(i, s, "train", self.data.shuffle_buffer, key)
        packer = Packer(Cursor([order], (1.0,), (*key, 7)), self.data.seq_len, self._pad_id(),
                        self.data.mode == "sft", self.data.on_bad_data, self.names)
        count = 0
        while True:
            packer.next()
            epoch, pos = packer.cursor.positions[0]
            if epoch > 1 or (epoch == 1 and (pos or packer.offset)):  # this sequence began the next pass
                return count
            count += 1
            if epoch == 1:
                return count

    def _order(self, i: int, s: int, split: str, buffer: int, key: tuple[int, ...]) -> DocumentOrder:
        lo, hi = 0, len(self.splits[i][split])
        n, k = hi - lo, self.num_streams
        if n >= k:  # disjoint contiguous slices, one per stream
            lo, hi, rotate, phase = lo + s * n // k, lo + (s + 1) * n // k, 0, 0.0
        else:  # too few documents to slice: every stream walks them all, from its own document and point in it
            rotate, phase = s % max(n, 1), (s // max(n, 1)) / -(-k // max(n, 1))
        return DocumentOrder(self.splits[i][split], lo, hi, rotate, buffer, (*key, i), self._encoder(i), phase)

    def _pad_id(self) -> int:
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def _encoder(self, i: int):
        source, tokenizer, data = self.data.sources[i], self.tokenizer, self.data
        if isinstance(self.sources[i], TokenSource):
            return lambda docs: [Encoded(list(d.record["ids"])) for d in docs]
        if data.mode == "sft":
            from clustertrain.data.sft import render_example

            def encode_sft(docs: list[Document]) -> list[Encoded | None]:
                def one(d: Document) -> Encoded:
                    ex = render_example(d.record, tokenizer, field=source.field, location=d.location)
                    return Encoded(ex.input_ids, ex.loss_mask if data.loss_on == "completion" else None)

                return [self._guard(one, d) for d in docs]

            return encode_sft

        eos = tokenizer.eos_token_id
        field = "text" if self.sources[i].format in ("text", "stdlib") else source.field

        def encode_text(docs: list[Document]) -> list[Encoded | None]:
            texts = [self._guard(lambda d: text_of(d, field), d) for d in docs]
            short = [t for t in texts if t is not None and len(t) <= PIECE_CHARS]
            ids = iter(tokenizer(short, add_special_tokens=False)["input_ids"] if short else [])
            return [None if t is None else Encoded([*next(ids), eos]) if len(t) <= PIECE_CHARS
                    else self._long_document((i, d.index), lambda t=t: encode_long(tokenizer, t, eos))
                    for d, t in zip(docs, texts)]

        return encode_text

    def _long_document(self, key: tuple[int, int], encode) -> Encoded:
        """A long document's encoding, made once for every stream that reads it (streams share the documents of a
        source with fewer documents than streams): the last LONG_KEPT are kept."""
        if key not in self._long:
            self._long[key] = Encoded(encode())
            while len(self._long) > LONG_KEPT:
                self._long.popitem(last=False)
        self._long.move_to_end(key)
        return self._long[key]

    def _guard(self, fn, doc: Document):
        """fn(doc), or None for a bad record when data.on_bad_data is skip (the packer counts it)."""
        try:
            return fn(doc)
        except DataError:
            if self.data.on_bad_data == "error":
                raise
            return None
