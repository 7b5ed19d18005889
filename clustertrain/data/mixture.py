"""Counter-based random choices: the same (seed, stream, counter) always gives the same draw.

Nothing here keeps a generator state, so a data position restores in O(1): the n-th draw of a stream is
recomputed from n, never replayed.
"""

from __future__ import annotations

import hashlib
import struct
from functools import lru_cache

import numpy as np


def uniform(*key: int) -> float:
    """A uniform number in [0, 1) determined by the integers of `key`."""
    digest = hashlib.blake2b(struct.pack(f"<{len(key)}q", *key), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def choose(weights: tuple[float, ...], *key: int) -> int:
    """Index i with probability weights[i] / sum(weights), determined by `key`."""
    if len(weights) == 1:
        return 0
    cumulative = _cumulative(weights)
    return int(np.searchsorted(cumulative, uniform(*key) * cumulative[-1], side="right"))


@lru_cache(maxsize=16)
def _cumulative(weights: tuple[float, ...]) -> np.ndarray:
    return np.cumsum(np.asarray(weights, dtype=np.float64))


def window_permutation(size: int, *key: int) -> np.ndarray:
    """The shuffle of one window of `size` documents, determined by `key`."""
    return np.random.default_rng(list(key)).permutation(size)


def derive_seed(*key: int) -> int:
    """A seed in [0, 2^63) determined by the integers of `key` (a new seed from an old one and a position)."""
    digest = hashlib.blake2b(struct.pack(f"<{len(key)}q", *key), digest_size=8, person=b"seed").digest()
    return int.from_bytes(digest, "little") >> 1
