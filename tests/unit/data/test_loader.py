from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import clustertrain.data.loader as loader_module
from clustertrain.config.data_schema import DataConfig
from clustertrain.data.loader import StreamLoader
from clustertrain.data.pack import IGNORE_INDEX, document_bounds
from clustertrain.data.plan import DataPlan, spec_changes
from clustertrain.data.tokenize import load_tokenizer
from clustertrain.distributed.collectives import set_rank_device
from clustertrain.errors import ConfigError, DataError

G = 12  # global batch: divisible by 1, 2, 3, 4


def write_jsonl(path, n, prefix, seed=0):
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for i in range(n):
            words = " ".join(f"{prefix}{int(w)}" for w in rng.integers(0, 50, rng.integers(3, 40)))
            f.write(json.dumps({"text": f"doc {i} {words}"}) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    return {"a": write_jsonl(root / "a.jsonl", 300, "alpha", 1), "b": write_jsonl(root / "b.jsonl", 200, "beta", 2),
            "root": root}


def make_plan(corpus, **overrides):
    fields = {"sources": [{"path": str(corpus["a"])}], "seq_len": 16, "vocab_size": 300, "shuffle_buffer": 8,
              "cache_dir": str(corpus["root"] / "cache"), **overrides}
    data = DataConfig.model_validate(fields)
    return DataPlan(data, load_tokenizer(data), G, seed=5, cache_dir=corpus["root"] / "cache")


def run(plan, dp_size, steps, state=None, workers=0):
    """Global batches (rows reassembled in rank order) and the merged position after them."""
    loaders = [StreamLoader(plan, rank, dp_size, workers) for rank in range(dp_size)]
    for loader in loaders:
        if state:
            loader.load_state_dict(state)
    batches = []
    for _ in range(steps):
        parts = [loader.next_batch() for loader in loaders]
        batches.append({k: torch.cat([p[k] for p in parts]) for k in ("input_ids", "labels", "position_ids")}
                       | {"origins": [o for p in parts for o in p["origins"]]})
    return batches, loaders[0].global_state([loader.local_state() for loader in loaders])


def same(a, b):
    return all(torch.equal(x["input_ids"], y["input_ids"]) and x["origins"] == y["origins"] for x, y in zip(a, b))


@pytest.mark.parametrize("dp_size", [2, 3, 4])
def test_global_batches_do_not_depend_on_rank_count(corpus, dp_size):
    plan = make_plan(corpus)
    reference, _ = run(plan, 1, 12)
    other, _ = run(plan, dp_size, 12)
    assert same(reference, other)


@pytest.mark.parametrize(("first", "second"), [(4, 2), (2, 1), (1, 3), (3, 4)])
def test_position_resumes_exactly_on_another_rank_count(corpus, first, second):
    plan = make_plan(corpus, sources=[{"path": str(corpus["a"]), "weight": 3}, {"path": str(corpus["b"])}])
    reference, _ = run(plan, 1, 30)
    _, state = run(plan, first, 17)
    assert state["batches"] == 17
    resumed, _ = run(make_plan(corpus, sources=[{"path": str(corpus["a"]), "weight": 3}, {"path": str(corpus["b"])}]),
                     second, 13, state=json.loads(json.dumps(state)))
    assert same(reference[17:], resumed)


def test_worker_processes_serve_the_same_batches(corpus):
    plan = make_plan(corpus)
    in_process, state0 = run(plan, 2, 8)
    with_workers, state2 = run(plan, 2, 8, workers=2)
    assert same(in_process, with_workers)
    assert state0 == state2


@pytest.mark.parametrize("workers", [0, 1])
def test_a_bad_record_read_by_a_worker_process_is_its_own_one_line_error(corpus, workers):
    bad = corpus["root"] / f"bad-{workers}.jsonl"
    bad.write_text(corpus["a"].read_text().replace("\n", "\n{oops\n", 1))  # line 2 is stream 0's second document
    with pytest.raises(DataError) as caught:  # the class itself, not torch's wrapper, and the message alone
        StreamLoader(make_plan(corpus, sources=[{"path": str(bad)}]), 0, 1, workers).next_batch()
    assert str(caught.value) == (f"{bad}:2: malformed JSON (Expecting property name enclosed in double quotes at "
                                 "column 2)")


def test_no_sample_repeats_within_an_epoch(corpus):
    batches, _ = run(make_plan(corpus), 1, 20)
    origins = [o[1:] for b in batches for o in b["origins"]]
    assert len(origins) == len(set(origins))


def test_packed_rows_are_contiguous_text_with_eos_between_documents(corpus):
    plan = make_plan(corpus, shuffle_buffer=1, doc_masking=True)
    batch, _ = run(plan, 1, 1)
    row, labels, positions = batch[0]["input_ids"][0], batch[0]["labels"][0], batch[0]["position_ids"][0]
    assert torch.equal(row[1:], labels[:-1])
    eos = plan.tokenizer.eos_token_id
    starts = (positions == 0).nonzero().flatten().tolist()
    for start in starts[1:]:
        assert row[start - 1] == eos, "a document starts right after the previous one's EOS"


def test_packed_positions_restart_at_0_right_after_each_eos(corpus):
    """Under doc masking a row's position ids count its tokens from the row's start and from 0 again right after
    each EOS (where the next document begins), exactly: shifted by one, a document would attend into the one
    before it."""
    plan = make_plan(corpus, seq_len=128, doc_masking=True)
    batch = StreamLoader(plan, 0, 1).next_batch()
    expected = positions_after_eos(batch["input_ids"].tolist(), plan.tokenizer.eos_token_id)
    for row, positions, want in zip(batch["input_ids"].tolist(), batch["position_ids"].tolist(), expected):
        assert positions == want, row
    documents = batch["cu_seq_lens"].tolist()
    assert documents == document_bounds(np.array(expected)).tolist()
    assert max(row.count(0) for row in expected) >= 3, "some row holds three documents or more"


def positions_after_eos(rows: list[list[int]], eos: int) -> list[list[int]]:
    """Each row's position ids worked out from its tokens alone: 0 at its start and right after each EOS."""
    out = []
    for row in rows:
        positions = [0]
        for token in row[:-1]:
            positions.append(0 if token == eos else positions[-1] + 1)
        out.append(positions)
    return out


def test_token_weighted_mixture_realizes_its_weights(corpus):
    plan = make_plan(corpus, sources=[{"path": str(corpus["a"]), "weight": 3}, {"path": str(corpus["b"])}])
    loader = StreamLoader(plan, 0, 1)
    tokens = {}
    for _ in range(40):
        for k, v in loader.next_batch()["tokens_by_source"].items():
            tokens[k] = tokens.get(k, 0) + v
    assert tokens["a"] / (tokens["a"] + tokens["b"]) == pytest.approx(0.75, abs=0.06)


def test_row_weighted_mixture_packs_both_sources_into_rows(corpus):
    plan = make_plan(corpus, mix_by="rows",
                     sources=[{"path": str(corpus["a"])}, {"path": str(corpus["b"])}], seq_len=64)
    rows = StreamLoader(plan, 0, 1).next_batch()
    text = plan.tokenizer.decode(rows["input_ids"].flatten())
    assert "alpha" in text and "beta" in text


@pytest.mark.parametrize("loss_on", ["completion", "all"])
def test_sft_rows_carry_loss_on_responses_or_on_everything(corpus, tmp_path, loss_on):
    path = tmp_path / "sft.jsonl"
    with path.open("w") as f:
        for i in range(60):
            f.write(json.dumps({"prompt": f"question {i} alpha{i % 7} ", "completion": f"answer beta{i % 5}"}) + "\n")
    plan = make_plan(corpus, mode="sft", sources=[{"path": str(path)}], seq_len=48, loss_on=loss_on)
    batch = StreamLoader(plan, 0, 1).next_batch()
    tok = plan.tokenizer
    for row, labels, positions in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
        trained = tok.decode([t for t in labels.tolist() if t != IGNORE_INDEX])
        assert "answer" in trained and ("alpha" in trained) == (loss_on == "all")  # a prompt word
        if loss_on == "all":  # only the padding carries no loss
            assert all(row[labels == IGNORE_INDEX] == plan._pad_id())
        assert positions[0] == 0 and (positions == 0).sum() >= 2, "examples restart positions"


# Bounded twice: by the packer (a whole pass of examples that do not fit is an error) and by this limit, so that a
# stream that never reaches the examples that fit (a dropped document) fails with its message instead of hanging.
@pytest.mark.timeout(60)
def test_an_sft_example_longer_than_a_row_is_an_error_or_a_counted_skip(corpus, tmp_path):
    path = tmp_path / "long.jsonl"
    with path.open("w") as f:
        for i in range(30):
            f.write(json.dumps({"prompt": "q " * (200 if i == 3 else 2), "completion": "a"}) + "\n")
    with pytest.raises(DataError, match="do not fit data.seq_len = 16"):
        loader = StreamLoader(make_plan(corpus, mode="sft", sources=[{"path": str(path)}], shuffle_buffer=1), 0, 1)
        for _ in range(3):
            loader.next_batch()
    loader = StreamLoader(make_plan(corpus, mode="sft", sources=[{"path": str(path)}], on_bad_data="skip",
                                    shuffle_buffer=1), 0, 1)
    for _ in range(3):
        loader.next_batch()
    assert loader.skipped["longer than seq_len"] >= 1


def test_random_tokens_need_no_data(corpus):
    plan = make_plan(corpus, mode="random", tokenizer=None)
    a, _ = run(plan, 1, 2)
    b, _ = run(plan, 2, 2)
    assert same(a, b) and a[0]["input_ids"].max() < plan.data.vocab_size


def test_token_files_are_windows_of_seq_len_plus_one(corpus, tmp_path):
    ids = np.arange(17 * 40, dtype=np.uint16) % 250
    ids.tofile(tmp_path / "shard0.bin")
    np.save(tmp_path / "shard1.npy", ids.astype(np.uint32))
    plan = make_plan(corpus, sources=[{"path": str(tmp_path / "shard*"), "format": "tokens"}], shuffle_buffer=1)
    assert len(plan.sources[0]) == 80
    batch = StreamLoader(plan, 0, 1).next_batch()
    first = batch["input_ids"][0]
    assert torch.equal(first, torch.from_numpy(ids[:16].astype(np.int64)))


def test_a_changed_data_spec_names_each_change_with_both_values():
    saved = {"data.sources": [{"path": "a", "weight": 1.0}], "data.seq_len": 16, "documents in data.sources": [10]}
    moved = {**saved, "data.sources": [{"path": "b", "weight": 1.0}], "documents in data.sources": [12]}
    assert spec_changes(saved, moved) == ['data.sources[0].path: "a" -> "b"', "documents in data.sources[0]: 10 -> 12"]
    added = {**saved, "data.sources": [*saved["data.sources"], {"path": "c", "weight": 1.0}]}
    assert spec_changes(saved, added) == ['data.sources: [{"path": "a", "weight": 1.0}] -> '
                                          '[{"path": "a", "weight": 1.0}, {"path": "c", "weight": 1.0}]']
    assert spec_changes(saved, saved) == []


def test_mismatched_position_and_indivisible_batch_are_user_errors(corpus):
    plan = make_plan(corpus)
    _, state = run(plan, 1, 2)
    with pytest.raises(DataError, match=r"other data: data.seq_len: 16 -> 32; restore it to resume$"):
        StreamLoader(make_plan(corpus, seq_len=32), 0, 1).load_state_dict(state)
    older = {k: v for k, v in state.items() if k != "data_spec"}  # a checkpoint from before data_spec
    with pytest.raises(DataError, match="data.sources, data.seq_len"):
        StreamLoader(make_plan(corpus, seq_len=32), 0, 1).load_state_dict(older)
    with pytest.raises(ConfigError, match="not divisible by the 5 data-parallel ranks"):
        StreamLoader(plan, 0, 5)


def test_a_global_batch_too_big_for_a_rank_is_refused_before_its_streams_exist(corpus):
    data = DataConfig.model_validate({"sources": [{"path": str(corpus["a"])}], "seq_len": 16, "vocab_size": 300,
                                      "cache_dir": str(corpus["root"] / "cache")})
    plan = DataPlan(data, load_tokenizer(data), 2**30, seed=5, cache_dir=corpus["root"] / "cache")
    with pytest.raises(ConfigError, match=r"train.global_batch_size = 1,073,741,824 puts 536,870,912 sequences .* on "
                                          r"each of the 2 data-parallel ranks; at most 65,536 per rank"):
        StreamLoader(plan, 0, 2)
    assert len(StreamLoader(plan, 0, 2**15).stream_ids) == 2**15  # enough ranks: fine


def test_eval_sources_are_the_held_out_set_and_the_sources_are_not_split(corpus):
    plan = make_plan(corpus, eval_fraction=0.1, eval_sources=[{"path": str(corpus["b"])}])
    assert len(plan.splits[0]["train"]) == 300 and not plan.splits[0]["eval"] and plan.has_eval()
    eval_plan, split = plan.for_split("eval")
    rows = StreamLoader(eval_plan, 0, 1, split=split).next_batch()
    text = plan.tokenizer.decode(rows["input_ids"].flatten())
    assert "beta" in text and "alpha" not in text
    assert "data.eval_fraction (0 with data.eval_sources)" in plan.spec()
    assert spec_changes(plan.spec(), make_plan(corpus, eval_fraction=0.1).spec()) == [
        "data.eval_fraction (0 with data.eval_sources): 0.0 -> 0.1"]


def test_document_bounds_start_at_every_row_and_every_restart():
    got = document_bounds(np.array([[0, 1, 2, 0, 1], [7, 8, 0, 1, 2]]))
    assert got.tolist() == [0, 3, 5, 7, 10] and got.dtype == np.int32


def test_a_batch_carries_its_documents_found_on_the_host(corpus):
    batch = StreamLoader(make_plan(corpus, seq_len=64), 0, 1).next_batch()
    rows, length = batch["position_ids"].shape
    # a document starts at position 0, or at a row's start (the rest of one begun in the row before), rows end to end
    starts = [r * length + i for r, row in enumerate(batch["position_ids"].tolist()) for i, p in enumerate(row)
              if p == 0 or i == 0]
    assert batch["cu_seq_lens"].tolist() == [*starts, rows * length]
    assert len(starts) > rows, "some row holds several documents"


@pytest.fixture
def pinned_allocator(monkeypatch):
    """CUDA's pinned host allocator stood in for (a CPU-only torch has none): records what it was handed."""
    handed = []
    monkeypatch.setattr(loader_module, "pinned", lambda tensor: handed.append(tensor) or tensor)
    return handed


def test_a_gpu_rank_gets_every_tensor_of_its_batches_in_pinned_memory(corpus, pinned_allocator):
    plan = make_plan(corpus)
    set_rank_device(torch.device("cuda", 0))  # only a device object: nothing is allocated there
    try:
        loader = StreamLoader(plan, 0, 1)
    finally:
        set_rank_device(torch.device("cpu"))
    loader.prefetch()  # a batch read ahead is pinned too
    batches = [loader.next_batch(), loader.next_batch()]
    tensors = [v for batch in batches for v in batch.values() if isinstance(v, torch.Tensor)]
    assert len(tensors) == 8 and all(any(t is p for p in pinned_allocator) for t in tensors)
    pinned_allocator.clear()
    StreamLoader(plan, 0, 1).next_batch()  # a CPU rank: its batches are not copied anywhere
    assert pinned_allocator == []


def test_pinning_needs_a_gpu_torch_can_see():
    if torch.cuda.is_available():
        assert loader_module.pinned(torch.ones(2)).is_pinned()
    else:  # why the tests stand the allocator in
        with pytest.raises(RuntimeError):
            loader_module.pinned(torch.ones(2))
