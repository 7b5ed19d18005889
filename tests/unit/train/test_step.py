from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from clustertrain.model.loss import token_loss_sum
from clustertrain.train.optim import Optimizers
from clustertrain.train.step import MAX_SKIPS_IN_A_ROW, NonFiniteSteps, StepResult, update


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def test_restarting_position_ids_keep_packed_documents_apart(model):
    a, b = torch.randint(0, 100, (1, 7)), torch.randint(0, 100, (1, 9))
    packed = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(7), torch.arange(9)])[None]
    with torch.no_grad():
        alone = model(input_ids=b).logits
        masked = model(input_ids=packed, position_ids=positions, use_cache=False).logits[:, 7:]
        unmasked = model(input_ids=packed).logits[:, 7:]
    assert torch.allclose(masked, alone, atol=1e-5)
    assert not torch.allclose(unmasked, alone, atol=1e-3), "without masking the second document sees the first"


def test_training_loss_uses_the_packed_masking(model):
    """token_loss_sum must not let a KV cache switch transformers' packed-sequence masking off."""
    a, b = torch.randint(0, 100, (1, 7)), torch.randint(0, 100, (1, 9))
    packed = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(7), torch.arange(9)])[None]
    labels = torch.full_like(packed, -100)
    labels[:, 7:] = packed[:, 7:]
    with torch.no_grad():
        alone = token_loss_sum(model, b, b)
        packed_loss = token_loss_sum(model, packed, labels, positions)
    assert packed_loss == pytest.approx(alone.item(), rel=1e-5)


def test_loss_sum_ignores_masked_labels(model):
    ids = torch.randint(0, 100, (2, 8))
    labels = ids.clone()
    full = token_loss_sum(model, ids, labels)
    labels[:, :4] = -100
    half = token_loss_sum(model, ids, labels)
    assert 0 < half < full


@pytest.mark.parametrize("kernel, on_nan, applied", [
    ("fused", "stop", False),  # skipped on the device, no host sync
    ("fused", "skip", False),
    ("foreach", "skip", False),  # one host read of the flag
    ("foreach", "stop", True),  # applied: the run stops at its next check, before any save
])
def test_a_non_finite_step_is_not_applied(kernel, on_nan, applied):
    weight = torch.nn.Parameter(torch.ones(3))
    adamw = torch.optim.AdamW([weight], lr=0.1, **{kernel: True})
    optimizer = Optimizers([adamw])
    weight.grad = torch.ones(3)
    assert update(optimizer, torch.tensor(1.0), None, on_nan)
    before = {k: v.clone() for k, v in adamw.state[weight].items()}, weight.detach().clone()
    weight.grad = torch.full((3,), float("nan"))
    assert not update(optimizer, torch.tensor(float("nan")), None, on_nan)
    state = adamw.state[weight]
    assert torch.isnan(weight).all().item() is applied
    if not applied:
        assert torch.equal(weight, before[1]) and all(torch.equal(state[k], v) for k, v in before[0].items())
        weight.grad = torch.ones(3)  # and the next finite step goes on as if the bad one never came
        update(optimizer, torch.tensor(1.0), None, on_nan)
        assert state["step"].item() == 2


def result(finite: bool, loss: float = 1.0) -> StepResult:
    return StepResult(torch.tensor(loss), torch.tensor(4), torch.tensor(1.0 if finite else float("nan")),
                      torch.tensor(finite))


def test_non_finite_steps_end_a_stop_run_at_the_first():
    steps = NonFiniteSteps("stop", torch.device("cpu"))
    steps.record(1, result(True))
    assert not steps.ended()
    steps.record(2, result(False, float("nan")))
    steps.record(3, result(False, 5.0))
    assert steps.ended() and steps.skipped() == 2
    message = str(steps.error(None, None, None, 3e-3))
    assert message.startswith("step 2: the loss (nan) or the gradient norm (nan) is not finite")
    assert "lower optim.lr (now 0.003) and start again" in message


def test_non_finite_steps_end_a_skip_run_after_ten_in_a_row():
    steps = NonFiniteSteps("skip", torch.device("cpu"))
    for step in range(1, 2 * MAX_SKIPS_IN_A_ROW):  # a finite step breaks the row
        steps.record(step, result(step == MAX_SKIPS_IN_A_ROW))
    assert not steps.ended() and steps.skipped() == 2 * MAX_SKIPS_IN_A_ROW - 2
    steps.record(2 * MAX_SKIPS_IN_A_ROW, result(False))
    assert steps.ended()
    assert str(steps.error(None, None, "ckpt/step-0000009", 1.0)).startswith(
        f"steps {MAX_SKIPS_IN_A_ROW + 1}-{2 * MAX_SKIPS_IN_A_ROW}: {MAX_SKIPS_IN_A_ROW} steps in a row")


def test_float16_overflows_are_the_scalers_business():
    steps = NonFiniteSteps("stop", torch.device("cpu"))
    steps.record(1, StepResult(torch.tensor(1.0), torch.tensor(4), torch.tensor(float("inf")), None))
    assert not steps.ended() and steps.skipped() == 0


def test_an_allocation_failure_is_one_line_naming_the_sizes():
    from clustertrain.train.step import OutOfMemory, out_of_memory_named

    cpu_failure = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                               "memory: you tried to allocate 512000000 bytes. Error code 12 (Cannot allocate memory)")
    for failure in (cpu_failure, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has\n"
                                                        "a total capacity of 79.1 GiB")):
        with pytest.raises(OutOfMemory) as caught, out_of_memory_named(4, 100_000):
            raise failure
        message = str(caught.value)
        assert message.startswith("out of memory in a micro-batch of train.micro_batch_size 4 x data.seq_len 100,000 "
                                  "tokens (") and "allocate" in message and "\n" not in message
        assert caught.value.exit_code == 2 and caught.value.__suppress_context__
    with pytest.raises(RuntimeError, match="shape mismatch"), out_of_memory_named(4, 128):
        raise RuntimeError("shape mismatch")  # not about memory: left as it is
