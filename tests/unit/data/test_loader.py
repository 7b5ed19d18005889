from __future__ import annotations

import numpy as np
import pytest
import torch

from clustertrain.data.loader import GlobalBatchLoader, PackedSequences
from clustertrain.errors import ConfigError, DataError


def sequences(n_tokens=1000, seq_len=8):
    return PackedSequences(np.arange(n_tokens, dtype=np.uint16), seq_len)


def global_batches(dp_size, steps, start_state=None, seq=None):
    """The rows of each global batch, reassembled from every rank's share."""
    seq = seq or sequences()
    loaders = [GlobalBatchLoader(seq, 12, rank, dp_size, seed=3) for rank in range(dp_size)]
    if start_state:
        for loader in loaders:
            loader.load_state_dict(start_state)
    return [torch.cat([l.next_batch()["input_ids"] for l in loaders]) for _ in range(steps)], loaders[0].state_dict()


def test_windows_overlap_by_one_token_and_labels_shift():
    seq = sequences()
    assert len(seq) == (1000 - 1) // 8
    batch = GlobalBatchLoader(seq, 4, 0, 1, seed=0, shuffle=False).next_batch()
    assert batch["input_ids"][0].tolist() == list(range(8))
    assert batch["labels"][0].tolist() == list(range(1, 9))
    assert batch["input_ids"][1, 0] == 8


@pytest.mark.parametrize("dp_size", [2, 3, 4])
def test_global_batches_do_not_depend_on_rank_count(dp_size):
    reference, _ = global_batches(1, 20)
    other, _ = global_batches(dp_size, 20)
    for a, b in zip(reference, other):
        assert torch.equal(a, b)


def test_position_resumes_on_another_rank_count():
    reference, _ = global_batches(1, 30)
    _, state = global_batches(4, 17)
    resumed, _ = global_batches(2, 13, start_state=state)
    for a, b in zip(reference[17:], resumed):
        assert torch.equal(a, b)


def test_an_epoch_serves_every_sequence_once_then_reshuffles():
    seq = sequences(n_tokens=12 * 8 * 5 + 1)  # 60 windows = 5 global batches
    batches, _ = global_batches(1, 10, seq=seq)
    first = torch.cat(batches[:5])[:, 0].tolist()
    second = torch.cat(batches[5:])[:, 0].tolist()
    assert sorted(first) == sorted(second) == [8 * i for i in range(60)]
    assert first != second


def test_split_holds_out_the_tail():
    train, held_out = sequences().split(0.1)
    assert len(train) + len(held_out) == len(sequences())
    assert held_out[0][0] == train[len(train) - 1][0] + 8


def test_mismatched_state_and_indivisible_batch_are_user_errors():
    loader = GlobalBatchLoader(sequences(), 12, 0, 1, seed=3)
    with pytest.raises(DataError, match="data or data.seq_len changed"):
        loader.load_state_dict({"batches": 3, "sequences": 5, "seed": 3})
    with pytest.raises(ConfigError, match="not divisible by the 5 data-parallel ranks"):
        GlobalBatchLoader(sequences(), 12, 0, 5, seed=3)
