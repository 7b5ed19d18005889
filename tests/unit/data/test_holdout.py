"""The held-out split: documents spread over each whole source, never trained on, the same for every rank count,
seed and resume; a position saved under the old tail split resumes only with `data.eval_split: tail`."""

from __future__ import annotations

import json
import re
from fractions import Fraction

import pytest
import torch
from helpers import TINY

from clustertrain.cli import main
from clustertrain.config.data_schema import DataConfig
from clustertrain.data.holdout import HeldOut
from clustertrain.data.loader import StreamLoader
from clustertrain.data.plan import DataPlan
from clustertrain.data.tokenize import load_tokenizer
from clustertrain.errors import DataError

G = 12  # streams: divisible by 1, 2, 3, 4
KINDS = ["river", "stone", "light", "cloud", "field"]  # the corpus lists 100 documents of each, kind after kind


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("by_kind")
    with (root / "docs.jsonl").open("w") as f:
        for index in range(500):
            kind = KINDS[index // 100]
            f.write(json.dumps({"text": f"{kind} doc {index}: " + " ".join([kind] * (3 + index % 7))}) + "\n")
    return root


def plan_of(corpus, seed=5, **data) -> DataPlan:
    config = DataConfig.model_validate({"sources": [{"path": str(corpus / "docs.jsonl")}], "seq_len": 16,
                                        "vocab_size": 300, "shuffle_buffer": 8, "cache_dir": str(corpus / "cache"),
                                        "eval_fraction": 0.05, **data})
    return DataPlan(config, load_tokenizer(config), G, seed=seed, cache_dir=corpus / "cache")


def sides(split: HeldOut) -> tuple[list[int], list[int]]:
    """(held-out, training) source indices, by position."""
    return ([split.index("eval", p) for p in range(split.count("eval"))],
            [split.index("train", p) for p in range(split.count("train"))])


@pytest.mark.parametrize(("n", "fraction"), [(10_000, 0.01), (1000, 0.3), (997, 0.15), (1234, 0.1234), (20, 0.1),
                                             (150, 0.01), (2, 0.01), (100_000, 0.00001)])
def test_held_out_documents_are_spread_over_the_source_and_never_trained_on(n, fraction):
    split = HeldOut(n, fraction)
    held, kept = sides(split)
    assert sorted(held + kept) == list(range(n)) and held == sorted(held) and kept == sorted(kept)
    assert {split.side(i) for i in held} == {"eval"} and {split.side(i) for i in kept} == {"train"}
    assert abs(len(held) - n * fraction) <= 1 and held
    share = Fraction(fraction).limit_denominator(10_000) or Fraction(1, round(1 / fraction))
    for start in range(0, n - share.denominator + 1, share.denominator):  # every whole block has its share
        assert sum(start <= i < start + share.denominator for i in held) == share.numerator, start
    tail = HeldOut(n, fraction, "tail")
    assert sides(tail)[0] == list(range(n - tail.count("eval"), n))  # the old split: the last documents


def test_the_split_is_a_fixed_hash_of_the_document_index():
    """The same documents on every machine, seed and run (pinned: a change here moves every run's split)."""
    assert sides(HeldOut(1000, 0.01))[0][:5] == [53, 147, 254, 366, 410]
    assert sides(HeldOut(300, 0.1))[0][:4] == [2, 18, 27, 33]
    split = HeldOut(1000, 0.01)
    assert [split.side(i) for i in range(1000)] == [HeldOut(1000, 0.01).side(i) for i in range(1000)]


def test_a_source_ordered_by_kind_holds_out_every_kind(corpus):
    def kinds_evaluated(plan) -> set[str]:
        text = plan.tokenizer.decode(StreamLoader(plan, 0, 1, split="eval").next_batch()["input_ids"].flatten())
        return {kind for kind in KINDS if kind in text}

    assert kinds_evaluated(plan_of(corpus)) == set(KINDS)
    assert kinds_evaluated(plan_of(corpus, eval_split="tail")) == {"field"}  # the flaw of issue 22


@pytest.mark.parametrize("side", ["train", "eval"])
def test_the_streams_read_exactly_their_side_and_every_document_is_the_one_indexed(corpus, side):
    plan = plan_of(corpus, eval_fraction=0.1)
    held = set(sides(HeldOut(500, 0.1))[0])
    orders = [plan.stream(s, side).packers[0].cursor.orders[0] for s in range(G)]
    read = {}
    for order in orders:
        for pos in range(order.length):
            index, encoded = order.at(0, pos)
            read[index] = plan.tokenizer.decode(encoded.ids)
    assert set(read) == (held if side == "eval" else set(range(500)) - held)
    documents = plan.splits[0][side]  # read as the streams read it: the other side's are never tokenized
    assert [d.index for d in documents.read(3, 40)] == [documents.index(p) for p in range(3, 40)]
    assert all(text.split(":")[0] == f"{KINDS[index // 100]} doc {index}" for index, text in read.items())


def batches(plan, dp_size, steps, side="train", state=None):
    loaders = [StreamLoader(plan, rank, dp_size, 0, split=side) for rank in range(dp_size)]
    for loader in loaders:
        if state:
            loader.load_state_dict(state)
    out = []
    for _ in range(steps):
        parts = [loader.next_batch() for loader in loaders]
        out.append((torch.cat([p["input_ids"] for p in parts]).tolist(), [o for p in parts for o in p["origins"]]))
    return out, loaders[0].global_state([loader.local_state() for loader in loaders])


@pytest.mark.parametrize(("first", "second"), [(3, 4), (2, 1)])
def test_the_split_is_the_same_on_every_rank_count_and_survives_a_resume(corpus, first, second):
    plan = plan_of(corpus, eval_fraction=0.1)
    held = set(sides(HeldOut(500, 0.1))[0])
    reference, _ = batches(plan, 1, 24)
    _, state = batches(plan, first, 11)
    resumed, _ = batches(plan_of(corpus, eval_fraction=0.1), second, 13, state=json.loads(json.dumps(state)))
    assert resumed == reference[11:]
    assert not {origin[2] for _, origins in reference for origin in origins} & held
    evaluated = batches(plan, 1, 2, "eval")[0]
    assert batches(plan, first, 2, "eval")[0] == evaluated and batches(plan_of(corpus, seed=9, eval_fraction=0.1),
                                                                       second, 2, "eval")[0] == evaluated
    assert {origin[2] for _, origins in evaluated for origin in origins} <= held


def test_a_position_saved_with_the_tail_split_resumes_only_with_it(corpus, tmp_path, capfd):
    """Runs before data.eval_split held out each source's tail: their data position, whose spec has no
    data.eval_split, is refused under the spread split in one line, and resumes with eval_split: tail."""
    tail = plan_of(corpus, eval_split="tail")
    assert "data.eval_split" not in tail.spec()  # so an older checkpoint's fingerprint is this one
    _, state = batches(tail, 1, 2)
    with pytest.raises(DataError, match=r'other data: data.eval_split: "tail" -> "spread"; restore it to resume$'):
        StreamLoader(plan_of(corpus), 0, 1).load_state_dict(state)
    StreamLoader(plan_of(corpus, eval_split="tail"), 0, 1).load_state_dict(state)
    StreamLoader(plan_of(corpus, eval_fraction=0), 0, 1).load_state_dict(batches(plan_of(corpus, eval_fraction=0,
                                                                                         eval_split="tail"), 1, 1)[1])

    run = [*TINY, f"data.sources=[{{path: {corpus / 'docs.jsonl'}}}]", "data.vocab_size=300",
           f"data.cache_dir={corpus / 'cache'}", "train.steps=2", f"train.run_dir={tmp_path / 'run'}"]
    assert main(["train", *(f"--set={o}" for o in run), "--set=data.eval_split=tail"]) == 0
    saved = {p: p.read_bytes() for p in (tmp_path / "run" / "checkpoints").rglob("*") if p.is_file()}
    capfd.readouterr()
    assert main(["train", *(f"--set={o}" for o in run), "--set=train.steps=3"]) == 2
    err = capfd.readouterr().err
    assert re.fullmatch(r'error: the checkpoint\'s data position was taken over other data: data.eval_split: '
                        r'"tail" -> "spread"; restore it to resume', err.strip()), err[-3000:]
    assert {p: p.read_bytes() for p in (tmp_path / "run" / "checkpoints").rglob("*") if p.is_file()} == saved
    assert main(["train", *(f"--set={o}" for o in run), "--set=train.steps=3", "--set=data.eval_split=tail"]) == 0
