"""No host sync in a training step that does not log: the counter (tests/host_syncs.py), then the 1-rank trainer's
real steps under it, on the default path, with packed documents, and with flash-attn's and FlexAttention's kernels
stood in for (they need a GPU). tests/distributed/test_syncs_and_stops.py counts a 2-rank run's steps."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY
from host_syncs import HostSyncs, flash_varlen_stand_in, flex_stand_in
from torch.nn.attention.flex_attention import BlockMask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel

import clustertrain.model.attention as attention
import clustertrain.model.build as model_build
from clustertrain.config.load import load_config
from clustertrain.data.pack import document_bounds
from clustertrain.train.trainer import Trainer

# ---- the counter ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sync", [
    lambda t: t.sum().item(), lambda t: bool(t[0]), lambda t: int(t[0]), lambda t: float(t.max()),
    lambda t: t.tolist(), lambda t: t.nonzero(), lambda t: torch.where(t > 1), lambda t: t[t > 1],
    lambda t: torch.equal(t, t), lambda t: torch.repeat_interleave(t.long()), lambda t: t.unique(),
    lambda t: t.to("meta", non_blocking=True),  # from pageable memory to a device (meta stands in for the GPU)
], ids=["item", "bool", "int", "float", "tolist", "nonzero", "where", "mask", "equal", "repeat_interleave",
        "unique", "pageable_copy"])
def test_the_counter_sees_each_kind_of_host_sync(sync):
    t = torch.tensor([1.0, 2.0, 3.0])
    with HostSyncs() as syncs:
        sync(t)
    assert len(syncs.found) == 1, syncs.report()
    where = syncs.found[0][1].split(" -> ")[0]
    assert where.startswith("test_host_syncs.py:") and where.endswith(" <lambda>"), syncs.report()  # who asked


def test_the_counter_passes_what_keeps_the_host_ahead():
    t = torch.tensor([1.0, 2.0, 3.0])
    with HostSyncs() as syncs:
        u = (t * 2).softmax(0).cumsum(0)
        torch.where(t > 1, t, u)  # the three-argument where: no size to read
        torch.repeat_interleave(t, torch.tensor([1, 2, 1]), output_size=4)
        t.to("cpu", non_blocking=True)
    assert syncs.found == [], syncs.report()
    assert torch.Tensor.tolist(t) == [1.0, 2.0, 3.0], "Tensor.tolist is restored"


def test_the_counter_leaves_out_what_it_is_told_to():
    with HostSyncs(allow=("test_host_syncs.py:read_on_purpose",)) as syncs:
        read_on_purpose(torch.ones(1))
        torch.ones(1).item()
    assert len(syncs.found) == 1


def read_on_purpose(t: torch.Tensor) -> float:
    return t.item()


# ---- the trainer's steps ---------------------------------------------------------------------------------------


@pytest.fixture
def stand_ins(monkeypatch):
    """Kernels that need a GPU, stood in for; what each was handed is recorded in `calls`."""
    import torch._dynamo

    calls: list = []
    monkeypatch.setattr(attention, "_batch", None)

    def flash():
        # flash-attn is neither installed nor able to run here: transformers' check for it and ours (the device)
        monkeypatch.setattr(PreTrainedModel, "_check_and_adjust_attn_implementation", lambda self, name, *a, **k: name)
        monkeypatch.setattr(model_build, "resolve_attention", lambda *args, **kwargs: "flash_attention_2")
        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", flash_varlen_stand_in(calls))
        return ["data.doc_masking=true"]

    def flex():
        monkeypatch.setattr(attention, "_flex_attention_trains_on_cpu", lambda: True)
        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flex_attention", flex_stand_in(calls))
        torch._dynamo.reset()  # create_block_mask compiles for this test's shapes alone (see test_attention.py)
        return ["data.doc_masking=true", "model.attn_implementation=flex_attention"]

    yield {"default": lambda: [], "doc_masking": lambda: ["data.doc_masking=true"], "flash": flash, "flex": flex}, calls
    torch._dynamo.reset()


@pytest.mark.parametrize("path", ["default", "doc_masking", "flash", "flex"])
def test_steps_that_do_not_log_make_no_host_sync(tmp_path, stand_ins, path):
    paths, calls = stand_ins
    config = load_config(None, [*TINY, f"train.run_dir={tmp_path}", "train.steps=6", "metrics.log_every=100",
                                "checkpoint.every=0", "train.sample_tokens=0", *paths[path]()])
    trainer = Trainer(config)
    try:
        trainer.build()
        trainer.start(trainer.resume())
        trainer.train_steps(1)  # step 1 logs
        calls.clear()
        with HostSyncs() as syncs:
            trainer.train_steps(2)  # steps 2 and 3 do not
        assert syncs.found == [], syncs.report()
        if path == "flash":  # each micro-batch's own rows' documents, as the loader found them
            positions = attention._batch.position_ids
            first_layer = calls[-4::2]  # the last step's two micro-batches of two layers each
            for (mask, lengths), rows in zip(first_layer, (slice(0, 4), slice(4, 8))):
                assert mask is None and lengths.tolist() == document_bounds(positions[rows].numpy()).tolist()
        if path == "flex":
            assert calls and all(isinstance(mask, BlockMask) for mask in calls)
    finally:
        trainer.close()
