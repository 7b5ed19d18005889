"""The held-out split: which documents of a source evaluation reads, and the two sides read like sources.

With `data.eval_split: spread` (the default), a source is cut into blocks of c consecutive documents and a of
each block are held out, a/c being `data.eval_fraction`: the a whose document index hashes lowest. The held-out
set therefore samples every part of a source, however it is ordered (files in order, a directory of projects,
rows sorted by domain), is the same for every seed, rank and process, and never meets the training side.
A side's position p maps to its document in O(1), so streams slice, shuffle and resume over positions as they
would over a source. `tail` holds out the last documents instead: how runs before `data.eval_split` split.

    split = HeldOut(len(source), 0.01, "spread")
    train = SplitSource(source, split, "train")     # train.read(0, 5): its first five documents
"""

from __future__ import annotations

from collections.abc import Iterator
from fractions import Fraction
from functools import lru_cache

import numpy as np

MAX_BLOCK = 10_000  # eval_fraction is taken as a/c with c at most this (0.0001 and 0.1234 are exact), or as 1/c


class HeldOut:
    """Which of a source's `n` documents are held out for evaluation (`eval`) and which are trained on (`train`)."""

    def __init__(self, n: int, fraction: float, how: str = "spread"):
        self.n, self.how = n, how
        share = Fraction(fraction).limit_denominator(MAX_BLOCK) if n > 1 else Fraction(0)
        if share == 0 and fraction > 0 and n > 1:
            share = Fraction(1, round(1 / fraction))
        self.a, self.c = share.numerator, share.denominator  # a of every c documents held out
        self.full = n // self.c  # whole blocks
        rest = n - self.full * self.c
        self.last = (2 * rest * self.a + self.c) // (2 * self.c)  # held out of the partial block, rounded
        if fraction > 0 and n > 1 and self.full == 0:
            self.last = max(1, self.last)  # a small source still holds one document out
        self.held = self.full * self.a + self.last
        if how == "tail":  # as runs before data.eval_split counted it, so that their positions stay valid
            self.held = max(1, round(n * fraction)) if fraction > 0 and n > 1 else 0

    def count(self, side: str) -> int:
        """How many documents `side` ("train" or "eval") has."""
        return self.held if side == "eval" else self.n - self.held

    def index(self, side: str, pos: int) -> int:
        """The source index of `side`'s document at position `pos` (positions keep the source's order)."""
        if self.how == "tail" or self.held == 0:
            return pos + (self.n - self.held if side == "eval" else 0)
        per_block = self.a if side == "eval" else self.c - self.a
        block, at = divmod(pos, per_block)
        if block > self.full:
            block, at = self.full, pos - self.full * per_block
        held, kept_before = self._block(block)
        if side == "eval":
            return block * self.c + int(held[at])
        return block * self.c + at + int(np.searchsorted(kept_before, at, side="right"))  # the held ones skipped

    def side(self, index: int) -> str:
        """"eval" if the document at source index `index` is held out, else "train"."""
        if self.how == "tail" or self.held == 0:
            return "eval" if index >= self.n - self.held else "train"
        block, at = divmod(index, self.c)
        held = self._block(block)[0]
        i = int(np.searchsorted(held, at))
        return "eval" if i < len(held) and held[i] == at else "train"

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        first = block * self.c
        return _held(first, min(self.c, self.n - first), self.last if block == self.full else self.a)


@lru_cache(maxsize=1024)
def _held(first: int, size: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The offsets, in order, of the `count` documents of the block of `size` from index `first` whose index
    hashes lowest, and how many training documents come before each of them."""
    hashes = _hash(np.arange(first, first + size, dtype=np.uint64))  # distinct: splitmix64 is a bijection
    held = np.sort(np.argpartition(hashes, count - 1)[:count]) if count else np.zeros(0, dtype=np.int64)
    return held, held - np.arange(count)


def _hash(index: np.ndarray) -> np.ndarray:
    """splitmix64 of document indices: a fixed hash, the same on every machine and numpy version."""
    x = (index + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class SplitSource:
    """One side of a source's held-out split, read like a source: position p is document `index(p)`."""

    def __init__(self, source, split: HeldOut, side: str):
        self.source, self.split, self.side = source, split, side
        self.label = source.label

    def __len__(self) -> int:
        return self.split.count(self.side)

    def index(self, pos: int) -> int:
        return self.split.index(self.side, pos)

    def read(self, start: int, stop: int) -> Iterator:
        """The documents at positions [start, stop), in order: one read of the source's documents they span,
        the other side's left out before anything tokenizes them."""
        start, stop = max(start, 0), min(stop, len(self))
        if start >= stop:
            return iter(())
        docs = self.source.read(self.index(start), self.index(stop - 1) + 1)
        return (d for d in docs if self.split.side(d.index) == self.side)
