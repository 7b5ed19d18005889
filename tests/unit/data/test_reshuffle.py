"""data.reshuffle_on_resume: each resume reads the epoch's unread documents in a new order, none repeated or left
out, on any rank count, packed into rows, with or without a shuffle buffer, alone or in a weighted mixture; a
changed seed is refused only without it."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest
from helpers import train

from clustertrain.config.data_schema import DataConfig
from clustertrain.data.audit import audit_report, expected_samples, read_audit, read_starts
from clustertrain.data.epoch_order import EpochOrder
from clustertrain.data.loader import StreamLoader
from clustertrain.data.plan import DataPlan
from clustertrain.data.tokenize import load_tokenizer
from clustertrain.errors import DataError
from clustertrain.resolve.load import load_checked_config
from clustertrain.run_dir import RunDir

G = 4  # streams (rows of a global batch)
RESTARTS = [(15, 2, 5), (33, 1, 5), (52, 4, 6)]  # (batches read before it, ranks after it, data.seed): all in epoch 0


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two sources of documents of 3 to 40 words, each text told apart by its source and number."""
    root = tmp_path_factory.mktemp("reshuffle")
    texts = {}
    for name, count, seed in (("alpha", 120, 1), ("beta", 80, 2)):
        rng = np.random.default_rng(seed)
        with (root / f"{name}.jsonl").open("w") as f:
            for i in range(count):
                words = rng.integers(0, 30, rng.integers(3, 40))
                texts[name, i] = f"doc {i} " + " ".join(f"{name}{int(w)}" for w in words)
                f.write(json.dumps({"text": texts[name, i]}) + "\n")
    return root, texts


def make_plan(root, seed=5, reshuffle=True, sources=("alpha",), **overrides):
    weights = {"alpha": 3.0, "beta": 1.0}
    data = DataConfig.model_validate({
        "sources": [{"path": str(root / f"{name}.jsonl"), "weight": weights[name]} for name in sources],
        "seq_len": 16, "vocab_size": 300, "shuffle_buffer": 8, "eval_fraction": 0, "reshuffle_on_resume": reshuffle,
        "cache_dir": str(root / "cache"), **overrides})
    return DataPlan(data, load_tokenizer(data), G, seed=seed, cache_dir=root / "cache")


def read(plan, dp, steps, state=None):
    """`steps` global batches on `dp` ranks from `state`: rows as (stream, source slot, tokens) and the position."""
    loaders = [StreamLoader(plan, rank, dp) for rank in range(dp)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    rows = []
    for _ in range(steps):
        for loader in loaders:
            batch = loader.next_batch()
            for origin, ids, labels in zip(batch["origins"], batch["input_ids"], batch["labels"]):
                rows.append((origin[0], origin[1], [*ids.tolist(), int(labels[-1])]))
    return rows, loaders[0].global_state([loader.local_state() for loader in loaders])


def documents(plan, rows):
    """Each (stream, lane)'s documents in the order read, as the texts its packed tokens decode to."""
    tokens = defaultdict(list)
    for stream, slot, ids in rows:
        tokens[stream, slot if plan.data.mix_by == "tokens" else 0] += ids
    eos, found = plan.tokenizer.eos_token_id, {}
    for lane, ids in tokens.items():
        cuts = [-1, *np.flatnonzero(np.asarray(ids) == eos)]
        found[lane] = [plan.tokenizer.decode(ids[a + 1:b]) for a, b in zip(cuts, cuts[1:])]
    return found


def first_pass(plan, rows, texts):
    """How often each document was read in its lane's first pass over its source (the documents before the lane's
    first repeat), each checked to be a whole document's text; every later whole pass (the epochs after the
    reshuffled ones) must read the same documents again, once each."""
    counted = defaultdict(int)
    for lane, read_texts in documents(plan, rows).items():
        by_source = defaultdict(list)
        for text in read_texts:
            key = (text.split()[2].rstrip("0123456789"), int(text.split()[1]))
            assert texts[key] == text, f"document {key} was not read whole: {text!r}"
            by_source[key[0]].append(key)
        for keys in by_source.values():
            seen = set()
            length = next((i for i, key in enumerate(keys) if key in seen or seen.add(key)), None)
            assert length, f"lane {lane} did not finish a pass; read more batches"
            passes = [keys[i:i + length] for i in range(0, len(keys) - length + 1, length)]
            assert all(sorted(p) == sorted(passes[0]) for p in passes), f"lane {lane}: a later epoch differs"
            for key in passes[0]:
                counted[key] += 1
    return counted


def reshuffled_run(root, restarts=RESTARTS, total=400, **plan_args):
    """Rows of a 2-rank start, then a restart at each of `restarts`; with each, the rows an unreshuffled restart
    from the same position would have read."""
    rows, state = read(make_plan(root, **plan_args), 2, restarts[0][0])
    unreshuffled = []
    ends = [at for at, _, _ in restarts[1:]] + [total]
    saved_by = 5  # the data.seed of the run that saved `state`
    for (at, dp, seed), end in zip(restarts, ends):
        unreshuffled.append(read(make_plan(root, seed=saved_by, reshuffle=False, **plan_args), dp, 10, state)[0])
        more, state = read(make_plan(root, seed=seed, **plan_args), dp, end - at, state)
        saved_by = seed
        assert more[:len(unreshuffled[-1])] != unreshuffled[-1], f"the restart at {at} drew the same order"
        rows += more
    return rows, state


@pytest.mark.parametrize("shuffle_buffer", [8, 1])
def test_three_restarts_with_new_seeds_read_every_document_of_the_epoch_once(corpus, shuffle_buffer):
    root, texts = corpus
    rows, state = reshuffled_run(root, shuffle_buffer=shuffle_buffer)
    counted = first_pass(make_plan(root, shuffle_buffer=shuffle_buffer), rows, texts)
    assert counted == {key: 1 for key in texts if key[0] == "alpha"}
    assert state["streams"][0]["seed"] == 5  # the draws keep the seed the run began with


@pytest.mark.parametrize("mix_by", ["rows", "tokens"])
def test_a_weighted_mixture_reshuffled_three_times_reads_each_source_once_per_epoch(corpus, mix_by):
    root, texts = corpus
    sources = {"sources": ("alpha", "beta"), "mix_by": mix_by}
    restarts = [(at, dp, seed + 1 + i) for i, (at, dp, seed) in enumerate(RESTARTS)]  # a new data.seed each time
    rows, state = reshuffled_run(root, restarts, total=520, **sources)
    assert first_pass(make_plan(root, **sources), rows, texts) == {key: 1 for key in texts}
    assert {stream["seed"] for stream in state["streams"]} == {5}  # the source of each document: drawn as before


def test_a_changed_seed_is_refused_in_one_line_naming_the_new_key_and_accepted_with_it(corpus):
    root, _ = corpus
    _, state = read(make_plan(root, reshuffle=False), 1, 3)
    with pytest.raises(DataError) as refused:
        read(make_plan(root, seed=6, reshuffle=False), 1, 1, state)
    message = str(refused.value)
    assert "data.seed (train.seed if unset): 5 -> 6" in message and "data.reshuffle_on_resume: true" in message
    assert "\n" not in message
    read(make_plan(root, seed=6), 1, 1, state)
    with pytest.raises(DataError, match="data.seq_len: 16 -> 32; restore it to resume$"):  # the rest still holds
        read(make_plan(root, seed=6, seq_len=32), 1, 1, state)


def test_a_resume_from_the_same_position_draws_the_same_new_order_on_any_rank_count(corpus):
    root, _ = corpus
    _, state = read(make_plan(root), 2, 5)
    assert read(make_plan(root), 2, 4, state)[0] == read(make_plan(root), 1, 4, state)[0]


def test_an_epoch_order_walked_across_reshuffles_is_a_permutation_and_keeps_what_was_read():
    length, buffer, key = 103, 8, (5, 1, 0, 0)
    whole = EpochOrder(length, buffer, key, 0, 5)
    plain = [w * buffer + i for w, i in map(whole.locate, range(length))]
    walked, reshuffles, start = [], [], 0
    for at, seed in [(13, 7), (40, 8), (41, 9), (96, 10), (length, None)]:
        order = EpochOrder(length, buffer, key, 0, 5, tuple(reshuffles))
        walked += [w * buffer + i for w, i in map(order.locate, range(start, at))]
        reshuffles.append((at, seed))
        start = at
    assert sorted(walked) == list(range(length)) and walked[:13] == plain[:13] and walked != plain
    final = EpochOrder(length, buffer, key, 0, 5, tuple(reshuffles[:-1]))
    assert [w * buffer + i for w, i in map(final.locate, range(length))] == walked  # the past, as it was read


@pytest.mark.dist
def test_a_two_rank_run_resumed_on_one_rank_reshuffles_and_its_audit_replays_the_new_order(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: " + " ".join(f"w{(i * 11 + j) % 53}" for j in range(30)) + "\n"
                              for i in range(64)))
    run_dir = tmp_path / "run"
    common = ("train.steps=5", f"data.sources=[{{path: {corpus}, text_unit: line}}]", "data.eval_fraction=0",
              "data.audit=true", "data.vocab_size=300", "checkpoint.every=1", "data.reshuffle_on_resume=true")
    train(run_dir, *common, "train.stop_after_steps=2", nproc=2)
    train(run_dir, *common)
    samples = RunDir(run_dir).samples
    recorded, starts = read_audit(samples), read_starts(samples)
    assert starts == [1, 3] and sorted(recorded) == [1, 2, 3, 4, 5]
    config = load_checked_config(RunDir(run_dir).config)
    report = audit_report(recorded, expected_samples(config, 5, starts))
    assert (report["repeated"], report["skipped"], report["unexpected"]) == ([], [], []), report
    unreshuffled = expected_samples(config, 5)
    # the rows after the resume first finish the documents it found part-read, then go on in a new order
    assert unreshuffled[2] == recorded[2] and unreshuffled[5] != recorded[5]
