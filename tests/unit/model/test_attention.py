"""Attention kernels: `auto` resolved per device and data, and packed documents kept apart by each kernel.

flex_attention runs for real on CPU (forward only: torch has no FlexAttention backward on CPU). flash-attn
cannot run here, so its varlen kernel is stood in for by the same computation in plain PyTorch, fed what
transformers would hand flash-attn (tests/host_syncs.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from host_syncs import HostSyncs, flash_varlen_stand_in
from torch.nn.attention.flex_attention import BlockMask
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import clustertrain.model.attention as attention
from clustertrain.errors import ConfigError
from clustertrain.data.pack import document_bounds
from clustertrain.model.attention import document_lengths, keep_packed_documents_apart, resolve_attention, use_documents
from clustertrain.model.build import build_meta_model
from clustertrain.model.loss import token_loss_sum

VOCAB = 100
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
# Two rows of 16 tokens; documents restart mid-row, at different places in each row.
PACKED = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3],
                       [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])


@pytest.fixture(scope="module")
def hf_config():
    return AutoConfig.for_model("llama", **LLAMA)


@pytest.fixture(scope="module")
def sdpa_model(hf_config):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(0, VOCAB, PACKED.shape, generator=torch.Generator().manual_seed(1))


def with_kernel(model, name: str):
    """A copy of `model` (same weights) that runs `name`, set as transformers would, without its checks."""
    other = copy.deepcopy(model)
    other.config._attn_implementation = name
    return other


def token_losses(model, input_ids, position_ids) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten(), reduction="none")


def layer_masks(model) -> list:
    """Records the attention mask each layer's attention receives."""
    seen = []
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(
            lambda module, args, kwargs: seen.append(kwargs.get("attention_mask")), with_kwargs=True)
    return seen


# ---- resolving `auto` and refusing what cannot run -----------------------------------------------------------


@pytest.fixture
def flash_installed(monkeypatch):
    monkeypatch.setattr(attention, "_flash_attn_problem", lambda: None)


def resolve(choice, hf_config, device="cuda", dtype=torch.bfloat16, packed=True, pipeline=False):
    return resolve_attention(choice, hf_config, device, dtype=dtype, packed_documents=packed, pipeline=pipeline)


def test_auto_is_sdpa_on_cpu_and_for_rows_of_one_document(hf_config, flash_installed):
    assert resolve("auto", hf_config, device="cpu") == "sdpa"
    assert resolve("auto", hf_config, packed=False) == "sdpa"


def test_auto_masks_packed_documents_on_gpu_without_a_dense_mask(hf_config, flash_installed, monkeypatch):
    assert resolve("auto", hf_config) == "flash_attention_2"
    assert resolve("auto", hf_config, dtype=torch.float32) == "flex_attention"  # flash-attn has no fp32
    assert resolve("auto", hf_config, pipeline=True) == "flex_attention"  # stages call the layers themselves
    monkeypatch.setattr(attention, "_flash_attn_problem", lambda: "needs the flash-attn package")
    assert resolve("auto", hf_config) == "flex_attention"
    gpt2 = AutoConfig.for_model("gpt2", n_layer=1)  # transformers has no flex_attention for GPT-2
    assert resolve("auto", gpt2) == "sdpa"


@pytest.mark.parametrize("choice", ["sdpa", "eager", "flex_attention", "flash_attention_2"])
def test_explicit_choices_are_kept_where_they_run(choice, hf_config, flash_installed):
    assert resolve(choice, hf_config) == choice
    if choice != "flash_attention_2":
        assert resolve(choice, hf_config, packed=False, pipeline=True, dtype=torch.float32) == choice


@pytest.mark.parametrize("device,dtype,pipeline,installed,says", [
    ("cpu", torch.bfloat16, False, True, "needs a CUDA or ROCm GPU and this run is on cpu; use auto or sdpa"),
    ("cuda", torch.bfloat16, False, False, "pip install flash-attn"),
    ("cuda", torch.float32, False, True, "parallel.param_dtype: bfloat16"),
    ("cuda", torch.bfloat16, True, True, "pipeline stages"),
])
def test_flash_attention_where_it_cannot_run_is_one_line(device, dtype, pipeline, installed, says, hf_config,
                                                         monkeypatch):
    if installed:
        monkeypatch.setattr(attention, "_flash_attn_problem", lambda: None)
    with pytest.raises(ConfigError, match="model.attn_implementation = flash_attention_2") as error:
        resolve("flash_attention_2", hf_config, device=device, dtype=dtype, pipeline=pipeline)
    assert says in str(error.value) and "\n" not in str(error.value)


def test_the_flash_attn_check_names_the_package_when_it_is_missing():
    if attention.importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    assert "pip install flash-attn" in attention._flash_attn_problem()


def test_flex_attention_is_refused_for_training_on_cpu_while_torch_cannot(hf_config):
    if attention._flex_attention_trains_on_cpu():
        assert resolve("flex_attention", hf_config, device="cpu") == "flex_attention"
        return
    with pytest.raises(ConfigError, match="model.attn_implementation = flex_attention cannot train on CPU"):
        resolve("flex_attention", hf_config, device="cpu")


def test_a_family_without_the_kernel_is_refused(flash_installed):
    with pytest.raises(ConfigError, match="no flex_attention for gpt2"):
        resolve("flex_attention", AutoConfig.for_model("gpt2", n_layer=1))


def test_the_meta_model_is_built_with_the_resolved_kernel(hf_config):
    model = build_meta_model(hf_config, None, torch.float32, "flex_attention")
    assert model.config._attn_implementation == "flex_attention"
    assert build_meta_model(hf_config).config._attn_implementation == "sdpa"


# ---- packed documents stay apart ---------------------------------------------------------------------------


@pytest.fixture
def fresh_flex():
    """Compiles flex_attention for this test's shapes alone: after a first compile with other shapes, dynamo
    would retrace with dynamic shapes, which torch 2.13's C++ FlexAttention template fails to compile on CPU."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_flex_attention_masks_packed_documents_as_sdpa_does_without_a_dense_mask(sdpa_model, input_ids, monkeypatch,
                                                                                 fresh_flex):
    dense_masks = []
    for name in ("sdpa", "eager"):  # the builders of dense [batch, 1, seq, seq] masks
        build = ALL_MASK_ATTENTION_FUNCTIONS[name]
        monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, name,
                            lambda *args, build=build, **kwargs: dense_masks.append(1) or build(*args, **kwargs))
    expected = token_losses(sdpa_model, input_ids, PACKED)
    assert dense_masks, "the spy missed sdpa's mask"
    dense_masks.clear()
    flex = copy.deepcopy(sdpa_model)
    flex.set_attn_implementation("flex_attention")
    masks = layer_masks(flex)
    got = token_losses(flex, input_ids, PACKED)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert dense_masks == []
    assert len(masks) == LLAMA["num_hidden_layers"] and all(isinstance(mask, BlockMask) for mask in masks)
    labels = torch.cat([input_ids[:, 1:], torch.full((input_ids.shape[0], 1), -100)], dim=1)
    with torch.no_grad():  # the training loss, packed documents included
        assert token_loss_sum(flex, input_ids, labels, PACKED) == pytest.approx(expected.sum().item(), rel=1e-5)


def test_flash_attention_keeps_the_documents_of_several_rows_apart(sdpa_model, input_ids, monkeypatch):
    calls = []
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", flash_varlen_stand_in(calls))
    expected = token_losses(sdpa_model, input_ids, PACKED)

    transformers_alone = with_kernel(sdpa_model, "flash_attention_2")
    leaky = token_losses(transformers_alone, input_ids, PACKED)
    assert not torch.allclose(leaky, expected, atol=1e-3), "transformers alone now keeps rows' documents apart"

    flash = with_kernel(sdpa_model, "flash_attention_2")
    keep_packed_documents_apart(flash)
    calls.clear()
    torch.testing.assert_close(token_losses(flash, input_ids, PACKED), expected, rtol=1e-5, atol=1e-5)
    assert len(calls) == LLAMA["num_hidden_layers"]
    assert all(mask is None and lengths is not None for mask, lengths in calls), "flash got a dense mask"
    # Without packed documents (no position ids) the hook stays out of the way.
    calls.clear()
    token_losses(flash, input_ids, None)
    assert all(lengths is None for _, lengths in calls)


def test_document_lengths_start_at_every_row_and_every_restart():
    got = document_lengths(torch.tensor([[0, 1, 2, 0, 1], [7, 8, 0, 1, 2]]))
    assert got["cu_seq_lens_q"].tolist() == [0, 3, 5, 7, 10]
    assert got["cu_seq_lens_q"].dtype == torch.int32 and got["cu_seq_lens_k"] is got["cu_seq_lens_q"]
    assert got["max_length_q"] == got["max_length_k"] == 5


# transformers' own check, at every forward given position ids, whether they restart (a read of one flag from the
# device); clustertrain cannot hand it an answer. Not counted here, so that what is counted is clustertrain's.
TRANSFORMERS_PROBE = "masking_utils.py:find_packed_sequence_indices"


@pytest.fixture
def flash_model(sdpa_model, monkeypatch):
    calls = []
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", flash_varlen_stand_in(calls))
    monkeypatch.setattr(attention, "_batch", None)
    flash = with_kernel(sdpa_model, "flash_attention_2")
    keep_packed_documents_apart(flash)
    return flash, calls


def test_flash_attention_takes_the_loaders_document_lengths_for_any_rows_of_the_batch(flash_model, sdpa_model,
                                                                                    input_ids):
    flash, calls = flash_model
    bounds = torch.from_numpy(document_bounds(PACKED.numpy()))  # as the loader hands them out
    on_device = bounds.clone()  # as the trainer copies them to the device
    use_documents(PACKED, bounds, on_device)
    expected = token_losses(sdpa_model, input_ids, PACKED)
    for rows in (slice(0, 2), slice(0, 1), slice(1, 2)):  # the batch, and each of its micro-batches of one row
        calls.clear()
        with HostSyncs(allow=(TRANSFORMERS_PROBE,)) as syncs:
            got = token_losses(flash, input_ids[rows], PACKED[rows])
        assert syncs.found == [], syncs.report()
        torch.testing.assert_close(got, expected.view(2, -1)[rows].flatten(), rtol=1e-5, atol=1e-5)
        lengths = calls[0][1]
        assert lengths.tolist() == document_bounds(PACKED[rows].numpy()).tolist()
        if rows.start == 0:  # the batch's own lengths on the device, not a copy
            assert lengths.untyped_storage().data_ptr() == on_device.untyped_storage().data_ptr()


def test_flash_attention_finds_the_lengths_itself_for_position_ids_of_another_batch(flash_model):
    flash, calls = flash_model
    use_documents(PACKED, torch.from_numpy(document_bounds(PACKED.numpy())), torch.zeros(1, dtype=torch.int32))
    other = PACKED.flip(0).contiguous()  # not rows of the batch given
    with HostSyncs() as syncs:
        token_losses(flash, torch.zeros_like(other), other)
    assert calls[0][1].tolist() == document_bounds(other.numpy()).tolist()
    assert "aten.nonzero.default" in [name for name, _ in syncs.found], "found on the device, at a host sync's cost"


def test_transformers_learns_from_the_batch_whether_rows_are_packed_without_asking_the_gpu():
    from host_syncs import HostSyncs
    from transformers import masking_utils

    from clustertrain.model.attention import rows_packed

    packed = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    single = torch.arange(6).expand(2, 6)
    with rows_packed(True), HostSyncs() as syncs:
        documents = masking_utils.find_packed_sequence_indices(packed)
    assert syncs.found == [], syncs.report()
    assert documents.tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]]  # transformers' own numbering
    with rows_packed(False):
        assert masking_utils.find_packed_sequence_indices(single) is None  # a plain causal mask
    # outside (generation, other callers) transformers decides by itself, as before
    assert masking_utils.find_packed_sequence_indices(single) is None
    assert masking_utils.find_packed_sequence_indices(packed).tolist() == documents.tolist()
