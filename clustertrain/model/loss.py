"""The training loss, in one place: next-token cross entropy summed over the labels that are not IGNORE_INDEX.

Two ways to compute it, chosen by `train.loss` (`resolve_loss`):

- full: the model's logits [b, t, vocab], upcast to fp32, then cross entropy (`full_loss_sum`). For a 128k
  vocabulary and 8,192 tokens per microbatch the fp32 logits alone take 4 GiB, and their gradient as much.
- chunked: the output layer and the cross entropy together, `train.loss_chunk_tokens` rows at a time
  (`chunked_loss_sum`): at most one chunk's fp32 logits [chunk, vocab] exist, in forward and in backward.
  On CUDA with `model.kernels: liger`, Liger's fused linear cross entropy takes its place.

The model computes the loss in its own forward, so FSDP2 (which gathers lm_head in the root's forward), DDP
and compile see an ordinary forward. `apply_loss_head` turns the meta model's lm_head into a `LossHead`: the
same nn.Linear with the same parameters (names, tying and checkpoints unchanged), which returns the summed
loss instead of logits while it has targets; `token_loss_sum` gives it the labels around the model call:

    apply_loss_head(meta, resolve_loss(train.loss, vocab_size), train.loss_chunk_tokens, parallel.compile)
    loss_sum = token_loss_sum(model, input_ids, labels, position_ids)   # training and evaluation

Without targets (generation, export) the head computes logits as before.

- Tensor parallel: the head is split by vocabulary rows (`clustertrain.parallel.vocab`): each tp rank holds
  [V/tp, H] and computes logits [..., V/tp] only. The cross entropy runs over the shards (`VocabShard`, as
  Megatron's vocab-parallel loss: per row the max all-reduced, then the exp-sum and the target's logit, which
  one rank owns, summed), chunked inside a LossHead or on the head's Shard(-1) DTensor logits for the full
  loss; no rank ever holds full logits. `full_logits` gathers them where a caller needs them whole. The
  sharded chunked loss runs eagerly under `parallel.compile` (its all-reduces stay outside the compiled blocks).
- Pipeline parallel: the last stage's rank hands the labels to its stage, whose head computes the loss;
  `output_loss_sum` turns a stage's output (a loss, or logits when the head returned them) into the loss.
- LoRA: peft leaves lm_head unadapted (it is frozen: the chunked loss then skips its weight gradient); a head
  that peft adapts keeps the full loss, and stays whole under tp.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from clustertrain.data.pack import IGNORE_INDEX
from clustertrain.distributed import collectives
from clustertrain.model.attention import rows_packed

CHUNKED_FROM_VOCAB = 32768  # train.loss auto: chunked from this vocabulary size on

# Model types whose causal-LM forward returns `lm_head(hidden)` untouched (read in their modeling_*.py):
# others scale or cap the logits after the head (Gemma 2/3 softcapping, Cohere, Granite), which a loss
# computed inside the head would skip.
PLAIN_HEAD_MODELS = {
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi", "phi3", "gemma", "gpt2",
    "opt", "olmo", "olmo2", "starcoder2", "gpt_neox", "falcon", "smollm3", "glm",
}

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]


def resolve_loss(loss: str, vocab_size: int) -> str:
    """`train.loss` as it runs: auto is chunked for a vocabulary of at least 32,768 tokens, else full."""
    if loss == "auto":
        return "chunked" if vocab_size >= CHUNKED_FROM_VOCAB else "full"
    return loss


def full_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross entropy of logits [..., vocab] against labels [...], in fp32; over the vocabulary
    shards when the logits are a vocabulary-split DTensor (a tp-split head's)."""
    if _is_dtensor(logits):
        return sharded_loss_sum(logits.to_local().flatten(0, -2), labels.flatten(), VocabShard.of(logits, dim=-1))
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def chunked_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                     chunk_tokens: int = 4096, shard: VocabShard | None = None) -> torch.Tensor:
    """`full_loss_sum(F.linear(hidden, weight, bias), labels)`, `chunk_tokens` rows at a time.

    Args:
        hidden: [N, H] inputs of the output layer.
        weight, bias: the output layer, [V, H] and [V] or None; with `shard`, this rank's rows of it.
        labels: [N] target ids; IGNORE_INDEX rows add nothing to the loss nor to the gradients.
        shard: where `weight` sits in a vocabulary split over ranks; every rank then returns the whole loss,
            and its gradient for `hidden` is this rank's part of a sum over the ranks (a Partial DTensor's).

    Neither the forward nor the backward holds more than one chunk's fp32 logits [chunk_tokens, V] (V/tp rows
    with `shard`).
    """
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, bias, labels, chunk_tokens, shard)
    return _chunks(hidden, weight, bias, labels, chunk_tokens, False, shard)[0]


class VocabShard:
    """This rank's place in a vocabulary split over the ranks of `group` (as torch.chunk splits it), and the two
    all-reduces a cross entropy over the shards needs (`group` None: the default group)."""

    def __init__(self, start: int, group: dist.ProcessGroup | None):
        self.start, self.group = start, group

    @classmethod
    def of(cls, tensor: torch.Tensor, dim: int = 0) -> VocabShard:
        """The shard of a DTensor split over one mesh dimension along `dim` (a head's weight, or its logits)."""
        mesh, size = tensor.device_mesh, tensor.shape[dim]
        assert mesh.ndim == 1 and tensor.placements[0].is_shard(), "a vocabulary split over one mesh dimension"
        rows = -(-size // mesh.size())
        return cls(min(mesh.get_local_rank() * rows, size), mesh.get_group())

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise max of `tensor` over the ranks."""
        return collectives.all_reduce(tensor, self.group, op="max")

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of `tensor` over the ranks."""
        return collectives.all_reduce(tensor, self.group)


class _LinearCrossEntropy(torch.autograd.Function):
    """Chunked linear + cross entropy whose forward also computes the gradients, as Liger's fused kernel does.

    Why gradients in forward rather than recomputing each chunk's logits in backward: it takes the three
    matmuls of the unchunked loss (logits, then the gradients of hidden and weight) where recomputation takes
    four, and what it keeps for backward is sized like its inputs (d hidden [N, H], d weight [V, H]), never
    [N, V]. Backward only scales them by the incoming gradient. Its price, paying for gradients that backward
    might not want, is avoided by `chunked_loss_sum`, which takes this path only when autograd records.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_tokens, shard):
        loss, *grads = _chunks(hidden, weight, bias, labels, chunk_tokens, True, shard)
        ctx.save_for_backward(*grads)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grads = [None if g is None else g * grad_loss for g in ctx.saved_tensors]
        return *grads, None, None, None


def sharded_loss_sum(logits: torch.Tensor, labels: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Summed token cross entropy of this rank's logits [N, V/tp] of a vocabulary split over ranks (`shard`)
    against labels [N]: the whole loss on every rank, the gradient of this rank's logits only."""
    return _ShardedCrossEntropy.apply(logits, labels, shard)


class _ShardedCrossEntropy(torch.autograd.Function):
    """`sharded_loss_sum`, its gradient computed in forward (as above) and kept in the logits' dtype."""

    @staticmethod
    def forward(ctx, logits, labels, shard):
        dtype = logits.dtype
        logits = logits.float() if dtype != torch.float32 else logits.clone()  # consumed in place below
        loss, d_logits = _softmax_loss(logits, labels, ctx.needs_input_grad[0], shard)
        ctx.save_for_backward(None if d_logits is None else d_logits.to(dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (d_logits,) = ctx.saved_tensors
        return None if d_logits is None else d_logits * grad_loss, None, None


def _chunks(hidden, weight, bias, labels, chunk_tokens, grads: bool, shard: VocabShard | None):
    """The summed loss and, with `grads`, its gradients for hidden, weight and bias (None where not needed)."""
    grad_hidden = torch.empty_like(hidden) if grads and hidden.requires_grad else None
    # The weight gradient sums over chunks in fp32 or wider (a frozen head, as under LoRA, needs none).
    grad_weight = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                              device=weight.device) if grads and weight.requires_grad else None
    grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) \
        if grads and bias is not None and bias.requires_grad else None
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        loss = loss + _chunk(hidden[rows], labels[rows], weight, bias, grads,
                             None if grad_hidden is None else grad_hidden[rows], grad_weight, grad_bias, shard)
    if not grads:
        return (loss,)
    return (loss, grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype))


def _chunk(h, y, weight, bias, grads: bool, grad_hidden, grad_weight, grad_bias, shard) -> torch.Tensor:
    """One chunk's summed loss; with `grads`, adds its gradients into the buffers that are not None.

    A function of its own, so that a chunk's [rows, V] tensors are freed before the next chunk's exist.
    """
    logits = F.linear(h, weight, bias)  # in the compute dtype, as the model's own head computes them
    dtype = logits.dtype
    loss, logits = _softmax_loss(logits.float(), y, grads, shard)
    if not grads:
        return loss
    d_logits = logits.to(dtype)  # in the compute dtype, as the model's head would receive it
    if grad_bias is not None:
        grad_bias += logits.sum(0)
    del logits  # the fp32 copy, when the compute dtype is lower
    if grad_hidden is not None:
        grad_hidden.copy_(d_logits @ weight)
    if grad_weight is not None:
        _add_product_fp32(grad_weight, d_logits.t(), h.to(d_logits.dtype))
    return loss


def _softmax_loss(logits: torch.Tensor, y: torch.Tensor, grads: bool, shard: VocabShard | None):
    """The summed loss of fp32 logits [rows, V] (this rank's columns with `shard`) against `y`, and with `grads`
    d loss / d logits (softmax - one_hot(target), zero on ignored rows), computed in place of `logits`: no second
    [rows, V] fp32 tensor exists."""
    valid = y != IGNORE_INDEX
    local = y if shard is None else y - shard.start
    owned = valid & (local >= 0) & (local < logits.shape[1])  # the target's logit is in this rank's columns
    target = torch.where(owned, local, 0).unsqueeze(1)
    picked = torch.where(owned.unsqueeze(1), logits.gather(1, target), 0.0)
    top = logits.amax(dim=1, keepdim=True)
    if shard is not None:
        top = shard.max(top)
    logits = logits.sub_(top).exp_()
    total = logits.sum(dim=1, keepdim=True)
    if shard is not None:  # one all-reduce for both: the exp-sum over all columns, the target's logit from its owner
        total, picked = shard.sum(torch.cat([total, picked], dim=1)).split(1, dim=1)
    loss = torch.where(valid, (top + total.log() - picked).squeeze(1), 0.0).sum()
    if not grads:
        return loss, None
    logits = logits.div_(total)
    logits.scatter_add_(1, target, -owned.unsqueeze(1).to(logits.dtype))
    return loss, logits.mul_(valid.unsqueeze(1))


def _add_product_fp32(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """`out += a @ b` in place, in `out`'s dtype (fp32 or wider), without rounding the product to `a`'s.

    Rounding each chunk's product before summing would add one rounding of the compute dtype per chunk to
    the head's gradient; here the weight gradient is rounded once, when `_chunks` converts it.
    """
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    elif out.is_cuda and torch.version.hip is None:  # the GEMM accumulates in fp32 into out: no [V, H] temporary
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:  # the CPU (and ROCm, unchecked) has no mixed-dtype addmm: one chunk's operands are upcast instead
        out.addmm_(a.to(out.dtype), b.to(out.dtype))


@functools.cache
def _compiled_chunked_loss_sum() -> LossFn:
    # dynamic=False: a step's shapes repeat (one for training, one for evaluation), and the chunk loop
    # unrolls over a concrete row count
    return torch.compile(chunked_loss_sum, dynamic=False)


def _compiled(hidden, weight, bias, labels, chunk_tokens):
    return _compiled_chunked_loss_sum()(hidden, weight, bias, labels, chunk_tokens)


class LossHead(nn.Linear):
    """The model's lm_head, which returns the summed token loss instead of logits while it has targets.

    Made by `apply_loss_head` (a class swap: the parameters stay the module's own). Targets come from
    `loss_targets` around an HF model's call, or as the `targets` argument from a pipeline stage, which
    passes them wherever a head has `takes_targets`.
    """

    takes_targets = True
    loss_fn: LossFn
    chunk_tokens: int
    _targets: torch.Tensor | None = None

    def forward(self, input: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        targets = self._targets if targets is None else targets
        if targets is None:
            return super().forward(input)
        if _is_dtensor(self.weight):  # split by vocabulary rows (clustertrain.parallel.vocab): the loss over shards
            return self._sharded_loss(input, targets)
        return self.loss_fn(input.flatten(0, -2), self.weight, self.bias, targets.flatten())

    def _sharded_loss(self, input: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The chunked loss on this rank's rows of the head; the input's gradient is this rank's part of a sum
        (Partial), which the input's DTensor reduces in backward (reduce-scattered under sequence parallelism)."""
        from torch.distributed.tensor import Partial

        hidden = input.to_local(grad_placements=[Partial()]) if _is_dtensor(input) else input
        bias = None if self.bias is None else self.bias.to_local()
        return chunked_loss_sum(hidden.flatten(0, -2), self.weight.to_local(), bias, targets.flatten(),
                                self.chunk_tokens, VocabShard.of(self.weight))


def apply_loss_head(model: nn.Module, loss: str, chunk_tokens: int, compile: bool = False,
                    fused: LossFn | None = None) -> tuple[str, str | None]:
    """Make `model`'s lm_head compute `loss` (resolved: "chunked" or "full") in the model's forward.

    Call it on the meta model (peft-wrapped or not), before parallelizing. `compile` compiles the chunked
    loss; `fused` (Liger's fused linear cross entropy, from `clustertrain.model.kernels`) replaces it.

    Returns:
        the loss that will run ("chunked", "fused" or "full"), and one line saying why, when it is full
        although chunked was asked.
    """
    if loss != "chunked":
        return "full", None
    from clustertrain.lora import is_lora

    hf_model = model.get_base_model() if is_lora(model) else model
    head = hf_model.get_output_embeddings()
    model_type = hf_model.config.model_type
    reason = None
    if model_type not in PLAIN_HEAD_MODELS:
        reason = f"{model_type} changes its logits after the head (or is not checked for it)"
    elif type(head) is not nn.Linear:
        reason = f"its lm_head is a {type(head).__name__} (LoRA-adapted?), not a plain linear layer"
    if reason:
        return "full", f"train.loss: chunked: {reason}; using the full loss"
    head.__class__ = LossHead
    head.chunk_tokens = chunk_tokens
    if fused is not None:
        head.loss_fn = fused
        return "fused", None
    head.loss_fn = functools.partial(_compiled if compile else chunked_loss_sum, chunk_tokens=chunk_tokens)
    return "chunked", None


@contextlib.contextmanager
def loss_targets(model: nn.Module, labels: torch.Tensor) -> Iterator[None]:
    """While open, `model`'s LossHead returns the summed loss against `labels` instead of logits."""
    heads = [m for m in model.modules() if isinstance(m, LossHead)]
    for head in heads:
        head._targets = labels
    try:
        yield
    finally:
        for head in heads:
            head._targets = None


def output_loss_sum(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed token loss from what the model returned: the loss itself when its head computed it (a
    scalar; one element from a pipeline stage), else logits, whose full loss it computes."""
    if output.dim() <= 1:
        return output.sum()
    return full_loss_sum(output, labels)


def token_loss_sum(
    model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Summed next-token cross entropy over the labels that are not IGNORE_INDEX.

    `position_ids` that restart inside a row mark packed documents; transformers then masks attention
    across them.
    """
    with loss_targets(model, labels), rows_packed(position_ids is not None):
        output = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    return output_loss_sum(output, labels)


def full_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits over the whole vocabulary: a tp-split head's Shard(-1) DTensor gathered (on every rank), else as
    they are. For callers that pick tokens or score them (the end-of-run sample, lm-eval); slice first."""
    return logits.full_tensor() if _is_dtensor(logits) else logits


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "device_mesh")


class TokenLoss:
    """The loss every layout trains with, handed to the runners (clustertrain.parallel.runner.TokenLoss)."""

    model_loss_sum = staticmethod(token_loss_sum)
    output_loss_sum = staticmethod(output_loss_sum)

