"""The order of one epoch of a stream's slice of a source, and the new orders that resumes draw over its rest.

A slice of `length` documents is cut into windows of `buffer` documents (the last one shorter); an epoch walks
the windows one after another, each in an order of its own. With `data.reshuffle_on_resume`, a resume at
position p draws a new order over the documents from p on, none of them repeated or left out:

- the window p falls in keeps the documents it has given, and the rest of it is put in a new order;
- the windows not yet begun come in a new order, each of them shuffled anew.

A reshuffle is two integers, (p, its seed), so a position that has been reshuffled stays a few integers. The
windows stay the unit read from disk: however many reshuffles, a document is still read with its window.
"""

from __future__ import annotations

import numpy as np

from clustertrain.data.mixture import window_permutation


class EpochOrder:
    """Epoch `epoch` of a slice of `length` documents in windows of `buffer`: position -> (window, index in it).

    `key` is the stream's (seed, stream, split, source); `seed` replaces its first element for this epoch, and
    each (position, seed) of `reshuffles` (in the order they were made, at positions that never decrease) draws
    a new order over the epoch's documents from that position on. With neither, this is the order every run
    walks: window w in place w, shuffled by (*key, epoch, w).
    """

    def __init__(self, length: int, buffer: int, key: tuple[int, ...], epoch: int, seed: int,
                 reshuffles: tuple[tuple[int, int], ...] = ()):
        self.length, self.buffer, self.rest, self.epoch = length, buffer, key[1:], epoch
        self.windows = -(-length // buffer)
        self.sequence: np.ndarray | None = None  # the window at each place; None: window w at place w
        self.cuts: list[tuple[int, int]] = [(0, seed)]  # (first place, seed): the seed of each place from it on
        self.cut_into: dict[int, np.ndarray] = {}  # window -> its order, for windows a reshuffle fell inside
        self._last: tuple[int, np.ndarray] | None = None  # (window, its order): the one being read
        self._short_place = self.windows - 1  # where the last, shorter window is
        for position, new_seed in reshuffles:
            if position < length:  # at the end of the epoch a reshuffle changes only the next epochs' seed
                self._reshuffle(position, new_seed)

    def locate(self, position: int) -> tuple[int, int]:
        """(window, index within it) of the document at `position` of this epoch."""
        place, offset = self._place(position)
        window = place if self.sequence is None else int(self.sequence[place])
        if self._last is None or self._last[0] != window:
            self._last = (window, self._window_order(window, place))
        return window, int(self._last[1][offset])

    def _reshuffle(self, position: int, seed: int) -> None:
        if self.sequence is None:
            self.sequence = np.arange(self.windows, dtype=np.int64)
        place, offset = self._place(position)
        if offset:  # the window being read keeps what it gave; the rest of it comes in a new order
            window = int(self.sequence[place])
            given, rest = np.split(self._window_order(window, place), [offset])
            self.cut_into[window] = np.concatenate(
                [given, rest[window_permutation(len(rest), seed, *self.rest, self.epoch, window, 1)]])
            place += 1
        later = self.sequence[place:]
        self.sequence[place:] = later[window_permutation(len(later), seed, *self.rest, self.epoch)]
        self.cuts.append((place, seed))
        self._last = None
        self._short_place = int(np.flatnonzero(self.sequence == self.windows - 1)[0])

    def _window_order(self, window: int, place: int) -> np.ndarray:
        if window in self.cut_into:
            return self.cut_into[window]
        seed = next(seed for first, seed in reversed(self.cuts) if first <= place)  # the seed it began under
        size = min(self.buffer, self.length - window * self.buffer)
        return window_permutation(size, seed, *self.rest, self.epoch, window)

    def _place(self, position: int) -> tuple[int, int]:
        """(place, offset in its window): every window holds `buffer` documents but the last one, wherever it
        has been put."""
        short, last = self.length - (self.windows - 1) * self.buffer, self._short_place
        if position < last * self.buffer:
            return divmod(position, self.buffer)
        if position < last * self.buffer + short:
            return last, position - last * self.buffer
        place, offset = divmod(position - last * self.buffer - short, self.buffer)
        return last + 1 + place, offset
