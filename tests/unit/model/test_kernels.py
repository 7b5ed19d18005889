"""Fused kernels: Liger where it applies, PyTorch's elsewhere, and never a broken start.

liger-kernel needs CUDA and triton, so it is not here: a stand-in package in sys.modules takes its place
(only what clustertrain calls: the family table, the instance patching, the fused loss), and a "cuda" device
(only its type is read) lets `apply_kernels` go as far as it goes on a GPU.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from host_syncs import HostSyncs
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama import modeling_llama

from clustertrain.data.pack import IGNORE_INDEX
from clustertrain.errors import ConfigError, UserError
from clustertrain.model.kernels import Kernels, apply_kernels, liger_unavailable

CUDA = torch.device("cuda")  # only its type is read: no GPU needed


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    return AutoModelForCausalLM.from_config(config)


class StandIn:
    """A liger-kernel installed in sys.modules for one test: `patch(model=..., **flags)` stands in for
    `_apply_liger_kernel_to_instance`; the fused loss records its keyword arguments and computes the loss."""

    def __init__(self, monkeypatch, patch=None, accum_dtype=True, broken_import=False):
        self.calls: list[dict] = []
        package = self._module(monkeypatch, "liger_kernel", package=True)
        transformers = self._module(monkeypatch, "liger_kernel.transformers", package=True)
        transformers._apply_liger_kernel_to_instance = patch or (lambda model, **flags: None)
        monkey_patch = self._module(monkeypatch, "liger_kernel.transformers.monkey_patch")
        if broken_import:  # as a triton built for another CUDA does while liger imports it
            def fail(name):
                raise RuntimeError("triton: libcuda.so cannot be found\nset TRITON_LIBCUDA_PATH")
            monkey_patch.__getattr__ = fail
        else:
            monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": None}
        functional = self._module(monkeypatch, "liger_kernel.transformers.functional")
        functional.liger_fused_linear_cross_entropy = self._fused_loss if accum_dtype else self._old_fused_loss
        package.transformers = transformers
        transformers.functional, transformers.monkey_patch = functional, monkey_patch

    @staticmethod
    def _module(monkeypatch, name, package=False):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
        monkeypatch.setitem(sys.modules, name, module)
        return module

    def _fused_loss(self, input, weight, target, bias=None, ce_weight=None, ignore_index=-100, reduction="mean",
                    accum_dtype=None, **kwargs):
        self.calls.append(dict(ignore_index=ignore_index, reduction=reduction, accum_dtype=accum_dtype, **kwargs))
        return F.cross_entropy(F.linear(input, weight, bias).float(), target, ignore_index=ignore_index,
                               reduction=reduction)

    def _old_fused_loss(self, input, weight, target, bias=None, ignore_index=-100, reduction="mean"):
        raise AssertionError("not called")


def patch_then_raise(model, **flags):
    """Liger's instance patching, stopped half way: a global swapped, one norm patched, then an error."""
    modeling_llama.apply_rotary_pos_emb = lambda *a, **k: None
    model.model.norm.forward = lambda hidden: hidden
    model.model.norm.casting_mode = "llama"
    raise RuntimeError("no kernel image is available for execution on the device\n(a second line)")


def unpatched(model) -> bool:
    return all("forward" not in m.__dict__ and "casting_mode" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("failure", ["patch", "import"])
def test_auto_falls_back_in_one_line_when_liger_fails(monkeypatch, failure):
    rope = modeling_llama.apply_rotary_pos_emb
    StandIn(monkeypatch, patch=patch_then_raise, broken_import=failure == "import")
    model = tiny_llama()
    kernels = apply_kernels(model, "auto", CUDA)
    assert kernels.name == "none" and kernels.linear_cross_entropy is None
    assert kernels.note.startswith("model.kernels: auto: liger-kernel fails on llama (RuntimeError: ")
    assert kernels.note.endswith("; using PyTorch kernels") and "\n" not in kernels.note
    assert unpatched(model) and modeling_llama.apply_rotary_pos_emb is rope  # PyTorch's kernels, as the note says


@pytest.mark.parametrize("failure", ["patch", "import"])
def test_an_explicit_liger_that_fails_is_a_one_line_config_error(monkeypatch, failure):
    rope = modeling_llama.apply_rotary_pos_emb
    StandIn(monkeypatch, patch=patch_then_raise, broken_import=failure == "import")
    model = tiny_llama()
    with pytest.raises(ConfigError) as raised:
        apply_kernels(model, "liger", CUDA)
    message = str(raised.value)
    assert isinstance(raised.value, UserError) and "\n" not in message
    assert message.startswith("model.kernels: liger: liger-kernel fails on llama (RuntimeError: ")
    assert "set model.kernels to auto or none" in message
    assert unpatched(model) and modeling_llama.apply_rotary_pos_emb is rope


def test_liger_patches_the_model_and_its_loss_accumulates_the_heads_gradient_in_fp32(monkeypatch):
    patched = []
    liger = StandIn(monkeypatch, patch=lambda model, **flags: patched.append((model, flags)))
    model = tiny_llama()
    kernels = apply_kernels(model, "liger", CUDA)
    assert kernels.name == "liger" and kernels.note is None
    assert patched == [(model, dict(rope=True, rms_norm=True, swiglu=True, geglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False))]
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(12, 32, generator=g), torch.randn(64, 32, generator=g, requires_grad=True)
    labels = torch.randint(0, 64, (12,), generator=g)
    labels[:4] = IGNORE_INDEX
    loss = kernels.linear_cross_entropy(hidden, weight, None, labels)
    assert liger.calls == [dict(ignore_index=IGNORE_INDEX, reduction="sum", accum_dtype=torch.float32)]
    assert torch.equal(loss, F.cross_entropy(hidden @ weight.T, labels, reduction="sum"))


def test_our_call_into_liger_does_not_wait_on_the_device(monkeypatch):
    """Liger's own kernel waits twice (`.item()` on the label count, `torch.equal` in backward); around it,
    nothing of ours may add a third (a count of labels, a boolean mask...)."""
    StandIn(monkeypatch)
    kernels = apply_kernels(tiny_llama(), "auto", CUDA)
    hidden, weight = torch.randn(12, 32, requires_grad=True), torch.randn(64, 32, requires_grad=True)
    labels = torch.randint(0, 64, (12,))
    labels[:4] = IGNORE_INDEX
    with HostSyncs() as syncs:
        kernels.linear_cross_entropy(hidden, weight, None, labels).backward()
    assert syncs.found == [], syncs.report()


def test_a_liger_without_fp32_accumulation_is_not_used(monkeypatch):
    StandIn(monkeypatch, accum_dtype=False)
    too_old = "this liger-kernel is too old: its fused loss takes no accum_dtype (pip install -U liger-kernel)"
    assert apply_kernels(tiny_llama(), "auto", CUDA) == Kernels(
        "none", note=f"model.kernels: auto: {too_old}; using PyTorch kernels")
    with pytest.raises(ConfigError) as error:  # asked for by name on a GPU: the start stops, exit 2
        apply_kernels(tiny_llama(), "liger", CUDA)
    assert str(error.value) == (f"model.kernels: liger: {too_old}; install a liger-kernel that runs here, or set "
                                "model.kernels to auto or none")


def test_liger_falls_back_on_cpu_with_one_line():
    model = tiny_llama()
    assert apply_kernels(model, "liger", torch.device("cpu")) == Kernels(
        "none", note="model.kernels: liger: liger needs CUDA; using PyTorch kernels")
    assert apply_kernels(model, "auto", torch.device("cpu")) == Kernels("none")  # nothing else was expected
    assert apply_kernels(model, "none", torch.device("cpu")) == Kernels("none")
    assert "Liger" not in type(model.model.norm).__name__ and "liger" not in str(model.model.norm.forward)


def test_liger_reasons_name_what_is_missing(monkeypatch):
    reason = liger_unavailable("llama", CUDA)
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        assert reason == "liger-kernel is not installed (pip install liger-kernel)"
    else:
        assert reason is None and liger_unavailable("no-such-family", CUDA) == "liger has no kernels for no-such-family"
    assert liger_unavailable("llama", torch.device("cpu")) == "liger needs CUDA"
    StandIn(monkeypatch)
    assert liger_unavailable("llama", CUDA, tp=2).startswith("liger is not combined with parallel.tp > 1")
    assert liger_unavailable("no-such-family", CUDA) == "liger has no kernels for no-such-family"
    assert liger_unavailable("llama", CUDA) is None
