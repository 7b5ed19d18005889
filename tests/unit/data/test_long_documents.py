"""A very long document is tokenized in pieces into one int32 array: the same tokens, in bounded memory."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from clustertrain.config.data_schema import DataConfig
from clustertrain.data import plan as plan_module
from clustertrain.data.pack import Encoded, Packer
from clustertrain.data.plan import PIECE_CHARS, encode_long, text_pieces
from clustertrain.data.tokenize import training_texts

LINES = [f"def f{i}(x):\n    return x * {i} + {i % 7}  # note {i}\n" for i in range(40000)]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(LINES[:2000], trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


@pytest.mark.parametrize("text", ["".join(LINES), "word " * 200_000, "x" * 600_000])
def test_pieces_cut_after_a_line_break_else_before_a_space_and_lose_nothing(text):
    pieces = text_pieces(text)
    assert "".join(pieces) == text and len(pieces) > 1
    assert all(len(p) <= PIECE_CHARS for p in pieces)
    if "\n" in text:
        assert all(p.endswith("\n") for p in pieces[:-1])
    elif " " in text:
        assert all(q.startswith(" ") for q in pieces[1:])  # the space opens the next word's token


def test_a_long_document_has_the_tokens_of_the_whole(tokenizer):
    text = "".join(LINES)  # about 1.7 M characters: 7 pieces
    ids = encode_long(tokenizer, text, tokenizer.eos_token_id)
    assert ids.dtype == np.int32 and len(text_pieces(text)) > 5
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.tolist() == [*whole, tokenizer.eos_token_id]


def test_packing_takes_an_array_document_as_it_takes_a_list():
    class One:  # a cursor over one document, forever
        count, orders = 0, [SimpleNamespace(phase=0.0)]

        def __init__(self, doc):
            self.doc = doc

        def current(self):
            return 0, 0, self.doc

        def advance(self):
            pass

        def current_epoch(self):
            return 0

        def documents(self):
            return 1

    ids = list(range(1, 100))
    packed = [Packer(One(Encoded(doc)), 8, 0, False, "error", ["a"]).next() for doc in (ids, np.asarray(ids, np.int32))]
    assert np.array_equal(packed[0].input_ids, packed[1].input_ids) and packed[1].input_ids.dtype == np.int64


def test_a_tokenizer_is_trained_on_a_long_document_in_pieces(tmp_path):
    text = "".join(LINES)
    (tmp_path / "big.txt").write_text(text)
    data = DataConfig.model_validate({"sources": [{"path": str(tmp_path / "big.txt")}], "cache_dir": str(tmp_path)})
    pieces = list(training_texts(data))
    assert "".join(pieces) == text and len(pieces) == len(text_pieces(text)) > 5


def test_streams_that_share_a_long_document_share_one_encoding(tokenizer, tmp_path, monkeypatch):
    (tmp_path / "big.txt").write_text("".join(LINES))
    calls = []
    monkeypatch.setattr(plan_module, "encode_long", lambda *args: calls.append(1) or encode_long(*args))
    data = DataConfig.model_validate({"sources": [{"path": str(tmp_path / "big.txt")}], "seq_len": 32,
                                      "eval_fraction": 0})
    plan = plan_module.DataPlan(data, tokenizer, 8, seed=0, cache_dir=tmp_path)
    streams = [plan.stream(s, "train") for s in range(8)]
    for stream in streams:
        stream.next()
    assert len(calls) == 1  # one document, eight streams: tokenized once
