"""A global, rank-independent order of packed sequences, dealt to data-parallel ranks.

Global batch k holds the sequences at global positions [k*G, (k+1)*G) of an endless stream of
per-epoch permutations seeded by (seed, epoch). The order therefore depends only on the data and the
seed; a rank reads the contiguous slice of each global batch that belongs to its data-parallel index,
and the saved position (`batches`, a count of global batches) restores on any number of ranks in O(1).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from clustertrain.errors import ConfigError, DataError


@dataclass(frozen=True)
class PackedSequences:
    """Fixed windows of `seq_len + 1` tokens over one token array; window i starts at i*seq_len."""

    tokens: np.ndarray
    seq_len: int
    first: int = 0
    count: int | None = None

    def __len__(self) -> int:
        total = (len(self.tokens) - 1) // self.seq_len
        return total - self.first if self.count is None else self.count

    def __getitem__(self, i: int) -> np.ndarray:
        start = (self.first + i) * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]

    def split(self, eval_fraction: float) -> tuple[PackedSequences, PackedSequences]:
        """Train and held-out windows: the last `eval_fraction` of the windows (at least one) are held out."""
        n = len(self)
        n_eval = max(1, round(n * eval_fraction)) if eval_fraction > 0 else 0
        if n - n_eval < 1:
            raise DataError(f"the data holds {n} sequences of {self.seq_len} tokens: too few to train on")
        train = PackedSequences(self.tokens, self.seq_len, self.first, n - n_eval)
        held_out = PackedSequences(self.tokens, self.seq_len, self.first + n - n_eval, n_eval)
        return train, held_out


class GlobalBatchLoader:
    """Serves this rank's share of each global batch; `state_dict()` is the same on every rank."""

    def __init__(self, sequences: PackedSequences, global_batch_size: int, dp_rank: int, dp_size: int,
                 seed: int, shuffle: bool = True):
        if global_batch_size % dp_size:
            raise ConfigError(
                f"train.global_batch_size = {global_batch_size} is not divisible by the {dp_size} data-parallel "
                f"ranks; use a multiple of {dp_size}"
            )
        self.sequences = sequences
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // dp_size
        self.dp_rank = dp_rank
        self.seed = seed
        self.shuffle = shuffle
        self.batches = 0

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches, "sequences": len(self.sequences), "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("sequences") != len(self.sequences) or state.get("seed") != self.seed:
            raise DataError(
                f"the checkpoint's data position was taken over {state.get('sequences')} sequences with seed "
                f"{state.get('seed')}, but this run has {len(self.sequences)} with seed {self.seed}: "
                "the data or data.seq_len changed"
            )
        self.batches = state["batches"]

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's rows of the next global batch: `input_ids` and `labels`, each [local_batch, seq_len]."""
        start = self.batches * self.global_batch_size + self.dp_rank * self.local_batch_size
        rows = np.stack([self.sequences[self._index(g)] for g in range(start, start + self.local_batch_size)])
        self.batches += 1
        window = torch.from_numpy(rows.astype(np.int64))
        return {"input_ids": window[:, :-1], "labels": window[:, 1:]}

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.sequences))
        if not self.shuffle:
            return offset
        return int(_permutation(len(self.sequences), self.seed, epoch)[offset])


@lru_cache(maxsize=2)
def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)
