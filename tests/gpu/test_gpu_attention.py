"""flash-attn's varlen kernel and flex attention in training on a GPU, forward and backward: per-token losses and
gradients on packed documents as sdpa's with its dense mask; and training runs that mask packed documents with
each kernel (the documents' starts from the loader)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from helpers import losses, train
from transformers import AutoConfig, AutoModelForCausalLM

from clustertrain.model.attention import keep_packed_documents_apart

VOCAB, ROWS, LENGTH = 512, 4, 128
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
# bf16 compute against the fp32 sdpa model: per-token losses differ by ~2e-3 at most, the gradient by ~5e-3 of
# its norm; attending across the documents instead moves losses by up to ~0.4 and the gradient by ~70% (measured
# on CPU with these shapes)
LOSS_ATOL, GRAD_RTOL = 2e-2, 3e-2
KERNELS = ["flash_attention_2", "flex_attention"]
FLASH_MISSING = ("flash-attn is not installed (pip install flash-attn --no-build-isolation): its varlen kernel is not "
                 "checked")


def skip_without(kernel: str) -> None:
    if kernel == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip(FLASH_MISSING)


@pytest.fixture(scope="module")
def packed():
    """Input ids and position ids of rows that each pack four documents, cut at different places."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(ROWS):
        cuts = sorted(set(torch.randint(1, LENGTH, (3,), generator=generator).tolist()))
        bounds = [0, *cuts, LENGTH]
        rows.append(torch.cat([torch.arange(end - start) for start, end in zip(bounds, bounds[1:])]))
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)
    return ids.cuda(), torch.stack(rows).cuda()


@pytest.fixture(scope="module")
def sdpa_model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **LLAMA), attn_implementation="sdpa").cuda()


def losses_and_grads(model, ids, positions, bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses and the gradient of their sum (all parameters, flattened), as a training step makes them."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    per_token = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    per_token.sum().backward()
    return per_token.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


def with_kernel(model, kernel: str):
    other = copy.deepcopy(model)
    other.set_attn_implementation(kernel)
    return other


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_kernel_trains_packed_documents_as_sdpa_does(kernel, sdpa_model, packed):
    skip_without(kernel)
    ids, positions = packed
    expected, expected_grads = losses_and_grads(sdpa_model, ids, positions, bf16=False)
    model = with_kernel(sdpa_model, kernel)
    if kernel == "flash_attention_2":
        keep_packed_documents_apart(model)
    got, grads = losses_and_grads(model, ids, positions, bf16=True)
    torch.testing.assert_close(got, expected, rtol=0, atol=LOSS_ATOL)
    assert (grads - expected_grads).norm() / expected_grads.norm() < GRAD_RTOL


def test_the_tolerances_catch_attention_across_documents(sdpa_model, packed):
    """flash-attn as transformers alone calls it with several rows attends across their documents."""
    skip_without("flash_attention_2")
    ids, positions = packed
    expected, expected_grads = losses_and_grads(sdpa_model, ids, positions, bf16=False)
    leaky, leaky_grads = losses_and_grads(with_kernel(sdpa_model, "flash_attention_2"), ids, positions, bf16=True)
    assert (leaky - expected).abs().max() > 5 * LOSS_ATOL
    assert (leaky_grads - expected_grads).norm() / expected_grads.norm() > 5 * GRAD_RTOL


PACKED_RUN = ["data.doc_masking=true", "parallel.param_dtype=bfloat16", "train.steps=6", "checkpoint.every=0"]


@pytest.fixture(scope="module")
def sdpa_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sdpa")
    train(run_dir, *PACKED_RUN, "model.attn_implementation=sdpa")
    return run_dir


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_run_on_packed_documents_trains_with_the_kernel(kernel, sdpa_run, tmp_path):
    skip_without(kernel)
    # TINY's two micro-batches a step: each gets its rows' share of the documents the loader found
    result = train(tmp_path, *PACKED_RUN, f"model.attn_implementation={kernel}")
    assert f"{kernel} attention" in result.stdout
    assert losses(tmp_path) == pytest.approx(losses(sdpa_run), rel=1e-2)
