"""The one loss: the chunked output layer + cross entropy equals the full loss, never holds [N, V] fp32 logits,
rounds the head's bf16 gradient once, never waits on the device, runs inside the model's head (plain, LoRA,
pipeline stage) and compiles without graph breaks. Liger's fused loss: tests/unit/model/test_kernels.py."""

from __future__ import annotations

import contextlib
import copy
import threading
from types import SimpleNamespace

import peft
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from host_syncs import HostSyncs
from torch.utils._pytree import tree_leaves
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from clustertrain.data.pack import IGNORE_INDEX
from clustertrain.parallel.stages import build_stage
from clustertrain.model.loss import (
    LossHead, VocabShard, apply_loss_head, chunked_loss_sum, full_loss_sum, output_loss_sum, resolve_loss,
    sharded_loss_sum, token_loss_sum,
)

N, H, V = 37, 16, 50  # a chunk of 8 rows does not divide 37


def inputs(bias: bool, frozen_weight: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=not frozen_weight)
    b = torch.randn(V, generator=g, requires_grad=True) if bias else None
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::3] = IGNORE_INDEX
    labels[8:16] = IGNORE_INDEX  # one whole chunk of 8 ignored
    return hidden, weight, b, labels


def loss_and_grads(fn, hidden, weight, bias, labels):
    params = [t for t in (hidden, weight, bias) if t is not None and t.requires_grad]
    loss = fn(hidden, weight, bias, labels)
    return loss.detach(), torch.autograd.grad(loss * 3.0, params)  # an upstream scale, as the step applies


def full(hidden, weight, bias, labels):
    return full_loss_sum(F.linear(hidden, weight, bias), labels)


def assert_relative(got, expected, rel=1e-6):
    """Equal to `rel` of the tensor's largest magnitude (elementwise relative fails on values near 0)."""
    assert (got - expected).abs().max() <= rel * expected.abs().max(), (got - expected).abs().max()


@pytest.mark.parametrize("chunk", [8, 37, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_loss_and_gradients_equal_the_full_loss(chunk, bias):
    args = inputs(bias)
    loss, grads = loss_and_grads(lambda *a: chunked_loss_sum(*a, chunk_tokens=chunk), *args)
    ref_loss, ref_grads = loss_and_grads(full, *args)
    assert_relative(loss, ref_loss)
    assert len(grads) == len(ref_grads) == (3 if bias else 2)
    for got, expected in zip(grads, ref_grads):
        assert_relative(got, expected)


@pytest.mark.parametrize("precision", ["autocast", "bfloat16_params"])
def test_in_bfloat16_the_chunked_loss_tracks_the_full_loss(precision):
    """DDP or one rank computes under autocast, FSDP on bf16 parameters; the logits are bf16 in both losses.
    The weight gradient differs by bf16 rounding only: the chunked loss sums its chunks' products in fp32."""
    hidden, weight, _, labels = inputs(bias=False)
    if precision == "bfloat16_params":
        hidden, weight = (t.detach().bfloat16().requires_grad_() for t in (hidden, weight))
    context = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "autocast" else contextlib.nullcontext()
    with context:
        loss, grads = loss_and_grads(lambda *a: chunked_loss_sum(*a, chunk_tokens=8), hidden, weight, None, labels)
        ref_loss, ref_grads = loss_and_grads(full, hidden, weight, None, labels)
    assert_relative(loss, ref_loss, rel=1e-5)
    for got, expected in zip(grads, ref_grads):
        assert got.dtype == expected.dtype
        assert_relative(got.float(), expected.float(), rel=2e-2)


def test_a_frozen_head_takes_no_weight_gradient_and_the_same_hidden_gradient():
    args = inputs(bias=False, frozen_weight=True)
    (loss, (d_hidden,)), (ref_loss, (ref_d_hidden,)) = (loss_and_grads(lambda *a: chunked_loss_sum(*a, 8), *args),
                                                        loss_and_grads(full, *args))
    assert_relative(loss, ref_loss)
    assert_relative(d_hidden, ref_d_hidden)


def test_without_autograd_only_the_loss_is_computed():
    hidden, weight, bias, labels = inputs(bias=True)
    with torch.no_grad():
        loss = chunked_loss_sum(hidden, weight, bias, labels, 8)
        assert_relative(loss, full(hidden, weight, bias, labels))
    assert loss.grad_fn is None


def test_in_bfloat16_the_heads_gradient_is_rounded_once():
    """bf16 weights, 32 chunks of 32 rows: each odd chunk repeats the one before with its hidden states negated
    (plus noise) and the same labels, so the head's gradient is a small difference of large chunk products, as
    near convergence. Rounding each chunk's product to bf16 before summing (as the loss did) erred 7.0e-3 here;
    summed in fp32 and rounded once, the error is about one bf16 rounding's (2.0e-3)."""
    n, h, v, chunk = 1024, 32, 64, 32
    g = torch.Generator().manual_seed(0)
    pairs = n // (2 * chunk)
    signs = torch.tensor([1.0, -1.0]).view(1, 2, 1, 1)
    hidden = (torch.randn(pairs, 1, 1, h, generator=g) * signs + torch.randn(pairs, 2, chunk, h, generator=g))
    labels = torch.randint(0, v, (pairs, 1, 1), generator=g).expand(pairs, 2, chunk).reshape(n)
    hidden, weight = hidden.reshape(n, h).bfloat16(), (0.1 * torch.randn(v, h, generator=g)).bfloat16()
    weight.requires_grad_()
    chunked_loss_sum(hidden, weight, None, labels, chunk_tokens=chunk).backward()
    reference = weight.detach().double().requires_grad_()
    full(hidden.double(), reference, None, labels).backward()
    assert weight.grad.dtype == torch.bfloat16
    error = (weight.grad.double() - reference.grad).norm() / reference.grad.norm()
    assert error < 2 ** -8, error


@pytest.mark.parametrize("precision", ["float32", "bfloat16_params", "autocast", "no_grad"])
def test_the_chunked_loss_does_not_wait_on_the_device(precision):
    """No `.item()`, boolean mask or `nonzero` per step: ignored labels are masked arithmetically."""
    hidden, weight, bias, labels = inputs(bias=precision != "bfloat16_params")
    if precision == "bfloat16_params":
        hidden, weight = (t.detach().bfloat16().requires_grad_() for t in (hidden, weight))
    context = {"autocast": torch.autocast("cpu", dtype=torch.bfloat16), "no_grad": torch.no_grad()}.get(
        precision, contextlib.nullcontext())
    with HostSyncs() as syncs, context:
        loss = chunked_loss_sum(hidden, weight, bias, labels, chunk_tokens=8)
        if loss.requires_grad:
            loss.backward()
    assert syncs.found == [], syncs.report()


def test_all_labels_ignored_is_zero_loss_and_zero_gradient():
    hidden, weight, _, labels = inputs(bias=False)
    loss, (d_hidden, d_weight) = loss_and_grads(lambda *a: chunked_loss_sum(*a, 8), hidden, weight, None,
                                                torch.full_like(labels, IGNORE_INDEX))
    assert loss == 0 and not d_hidden.any() and not d_weight.any()


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op creates (forward and backward, saved or temporary)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.numel = max([self.numel] + [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out


def largest_tensors(fn, n=64, h=8, v=1000):
    """(largest tensor created, largest tensor saved for backward) by fn's forward and backward."""
    hidden, weight = torch.randn(n, h, requires_grad=True), torch.randn(v, h, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    saved = [0]

    def pack(t):
        saved[0] = max(saved[0], t.numel())
        return t

    with LargestTensor() as mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(hidden, weight, None, labels).backward()
    return mode.numel, saved[0]


def test_the_chunked_loss_never_holds_the_full_logits():
    n, v, chunk = 64, 1000, 16
    created, saved = largest_tensors(lambda *a: chunked_loss_sum(*a, chunk_tokens=chunk), n=n, v=v)
    assert created <= chunk * v, "a tensor larger than one chunk's logits was created"
    assert saved < n * v
    # the measure sees the full loss's logits, so it would see them in the chunked loss too
    created, saved = largest_tensors(full, n=n, v=v)
    assert created >= n * v and saved >= n * v


def test_the_chunked_loss_compiles_without_graph_breaks():
    hidden, weight, bias, labels = inputs(bias=True)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(chunked_loss_sum)(hidden, weight, bias, labels, 8)
    assert explained.graph_break_count == 0, explained.break_reasons
    with torch.no_grad():
        explained = torch._dynamo.explain(chunked_loss_sum)(hidden, weight, bias, labels, 8)
    assert explained.graph_break_count == 0, explained.break_reasons


def test_auto_is_chunked_from_a_32k_vocabulary():
    assert resolve_loss("auto", 32768) == "chunked" and resolve_loss("auto", 32767) == "full"
    assert resolve_loss("full", 128256) == "full" and resolve_loss("chunked", 512) == "chunked"


def tiny_llama(tied: bool = False):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def batch(vocab=512):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 24), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    labels[0, :5] = IGNORE_INDEX
    return ids, labels


def grads_of(model, ids, labels):
    model.zero_grad()
    loss = token_loss_sum(model, ids, labels)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [False, True])
def test_the_models_head_computes_the_chunked_loss(tied):
    plain = tiny_llama(tied)
    chunked = copy.deepcopy(plain)
    names = [n for n, _ in chunked.named_parameters(remove_duplicate=False)]
    assert apply_loss_head(chunked, "chunked", chunk_tokens=7) == ("chunked", None)
    assert isinstance(chunked.lm_head, LossHead)
    assert [n for n, _ in chunked.named_parameters(remove_duplicate=False)] == names  # checkpoints unchanged
    assert (chunked.lm_head.weight is chunked.model.embed_tokens.weight) == tied
    ids, labels = batch()
    (loss, grads), (ref_loss, ref_grads) = grads_of(chunked, ids, labels), grads_of(plain, ids, labels)
    assert_relative(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert_relative(grads[name], ref_grads[name], rel=1e-5)  # through the blocks: fp32 summation order
    with torch.no_grad():  # no targets: logits, as generation needs
        assert torch.equal(chunked(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_lora_keeps_the_chunked_head_and_trains_its_adapters_alike():
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    plain = peft.get_peft_model(tiny_llama(), config)
    chunked = copy.deepcopy(plain)
    assert apply_loss_head(chunked, "chunked", chunk_tokens=16)[0] == "chunked"
    ids, labels = batch()
    (loss, grads), (ref_loss, ref_grads) = grads_of(chunked, ids, labels), grads_of(plain, ids, labels)
    assert_relative(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and all(".lora_" in n for n in grads)
    for name in grads:
        assert_relative(grads[name], ref_grads[name], rel=1e-5)


def test_a_lora_adapted_head_keeps_the_full_loss():
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"])
    model = peft.get_peft_model(tiny_llama(), config)
    kind, note = apply_loss_head(model, "chunked", chunk_tokens=16)
    assert kind == "full" and note.startswith("train.loss: chunked: ") and "using the full loss" in note


def test_a_model_that_changes_its_logits_after_the_head_keeps_the_full_loss():
    config = AutoConfig.for_model("gemma2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    kind, note = apply_loss_head(model, "chunked", chunk_tokens=16)
    assert kind == "full" and "gemma2" in note and not isinstance(model.lm_head, LossHead)


def test_a_fused_loss_replaces_the_chunked_one():
    model = tiny_llama()
    calls = []

    def fused(hidden, weight, bias, labels):
        calls.append(hidden.shape)
        return full(hidden, weight, bias, labels)

    assert apply_loss_head(model, "chunked", 16, fused=fused) == ("fused", None)
    ids, labels = batch()
    token_loss_sum(model, ids, labels)
    assert calls == [torch.Size([48, 64])]


def test_the_last_pipeline_stage_computes_the_loss_from_its_labels():
    model = tiny_llama()
    ids, labels = batch()
    with torch.no_grad():
        expected = token_loss_sum(model, ids, labels)
    apply_loss_head(model, "chunked", chunk_tokens=5)
    first, last = build_stage(model, 0, 2), build_stage(model, 1, 2)
    outputs = first(ids, None, labels=labels)
    assert len(outputs) == 2  # labels do not travel: the last stage's rank passes them itself
    loss = last(*outputs, labels=labels)
    assert loss.shape == (1,)  # one element per microbatch: the schedule concatenates them
    assert_relative(output_loss_sum(loss, labels), expected, rel=1e-5)
    assert last(*outputs).shape == (2, 24, 512)  # without labels: logits


# ---- the loss over vocabulary shards (tp): the math on split tensors, one thread per shard --------------------------
class ThreadShard(VocabShard):
    """Shard `index` of a vocabulary split `n` ways, computed by one thread of n: its all-reduces meet the other
    threads' at a barrier (what gloo does between tp ranks, in one process). The reductions are real."""

    def __init__(self, start: int, index: int, slots: list, barrier: threading.Barrier):
        super().__init__(start, None)
        self.index, self.slots, self.barrier = index, slots, barrier

    def max(self, tensor):
        return self._reduce(tensor, torch.maximum)

    def sum(self, tensor):
        return self._reduce(tensor, torch.add)

    def _reduce(self, tensor, op):
        self.slots[self.index] = tensor.clone()
        self.barrier.wait()
        result = self.slots[0]
        for other in self.slots[1:]:
            result = op(result, other)
        self.barrier.wait()  # every thread has read the slots before any writes the next reduction's
        return tensor.copy_(result)


def over_shards(parts: int, fn) -> list:
    """`fn(shard, rows)` on `parts` threads, one per torch.chunk of the vocabulary; each one's result."""
    sizes = [len(rows) for rows in torch.arange(V).chunk(parts)]
    starts = [sum(sizes[:i]) for i in range(parts)]
    slots, barrier, results = [None] * parts, threading.Barrier(parts), [None] * parts

    def run(i):
        results[i] = fn(ThreadShard(starts[i], i, slots, barrier), slice(starts[i], starts[i] + sizes[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(parts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(r is not None for r in results), "a shard's thread failed"
    return results


@pytest.mark.parametrize("parts", [2, 3])  # 50 rows in 3 shards: 17 + 17 + 16
@pytest.mark.parametrize("form", ["chunked", "full", "chunked_frozen_head"])
def test_the_loss_over_vocabulary_shards_equals_the_full_loss(parts, form):
    """Every shard computes the whole loss; each shard's weight and bias gradients are its rows of the full ones,
    and the hidden gradients of the shards sum to the full one (a Partial DTensor's, reduced by the head's input)."""
    hidden, weight, bias, labels = inputs(bias=True, frozen_weight=form == "chunked_frozen_head")
    labels[0] = V - 1  # a target in the last shard, and in the first
    labels[1] = 0
    ref_loss, ref_grads = loss_and_grads(full, hidden, weight, bias, labels)

    def shard_loss(shard, rows):
        h = hidden.detach().clone().requires_grad_()
        w = weight.detach()[rows].clone().requires_grad_(weight.requires_grad)
        b = bias.detach()[rows].clone().requires_grad_()
        if form == "full":
            loss = sharded_loss_sum(F.linear(h, w, b), labels, shard)
        else:
            loss = chunked_loss_sum(h, w, b, labels, chunk_tokens=8, shard=shard)
        return loss.detach(), torch.autograd.grad(loss * 3.0, [t for t in (h, w, b) if t.requires_grad])

    results = over_shards(parts, shard_loss)
    for loss, _ in results:
        assert_relative(loss, ref_loss)
    assert_relative(sum(grads[0] for _, grads in results), ref_grads[0], rel=1e-5)
    for reference, shards in zip(ref_grads[1:], list(zip(*(grads for _, grads in results)))[1:]):
        assert_relative(torch.cat(shards), reference, rel=1e-5)


def test_a_shard_starts_where_torch_chunk_cuts_the_vocabulary():
    """A split head's shard starts at its rank's torch.chunk of the vocabulary, as DTensor's Shard(0) cuts it (uneven
    when tp does not divide it: 50 rows in 4 shards of 13, 13, 13 and 11)."""
    def mesh(rank):
        return SimpleNamespace(ndim=1, size=lambda: 4, get_local_rank=lambda: rank, get_group=lambda: None)

    from torch.distributed.tensor import Shard

    starts = [VocabShard.of(SimpleNamespace(device_mesh=mesh(r), placements=(Shard(0),), shape=(50, H))).start
              for r in range(4)]
    assert starts == [int(rows[0]) for rows in torch.arange(50).chunk(4)] == [0, 13, 26, 39]
