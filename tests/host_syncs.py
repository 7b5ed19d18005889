"""Count the operations that make the host wait for the GPU: a training step that does not log may run none.

    with HostSyncs() as syncs:
        trainer.train_steps(2)
    assert syncs.found == [], syncs.report()

A CUDA kernel launch returns at once, and the host goes on to queue the next ones. The operations below stop
the host until the GPU has caught up, so the GPU's queue runs dry while the host prepares what comes next.
`HostSyncs` (a TorchDispatchMode, plus a wrapper around `Tensor.tolist`, which dispatches no operation)
records each one with the code that asked for it:

- the host reads a tensor's value: `aten._local_scalar_dense` (`.item()`, `bool(t)`, `int(t)`, `float(t)`,
  `if t:`), `aten.is_nonzero`, `aten.equal`, `Tensor.tolist()` (reading the result of a collective this way
  also waits for the slowest rank: how a stop agreement or a logged loss shows up);
- an output whose size depends on the values: `aten.nonzero` (also under `argwhere` and `torch.where(cond)`),
  `aten.masked_select`, indexing with a boolean mask (`aten.index` with a bool index), `aten.unique*`, and
  `aten.repeat_interleave` without `output_size`;
- a copy from a CPU tensor in pageable (not pinned) memory to another device (`aten._to_copy`, `aten.copy_`),
  which CUDA performs synchronously even when asked for `non_blocking`, and a copy from a device to the CPU.

No GPU is here, so the CPU's tensors stand in for the GPU's: a read counts whatever its tensor's device. The
pinned-memory rule needs a device that is not the CPU; tests use the meta device to see it work. Kernels that
need a GPU are stood in for by plain PyTorch that makes no sync of its own (`flash_varlen_stand_in`,
`flex_stand_in`), so that what is counted is what clustertrain and transformers hand them.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
VALUE_SIZED = {aten.nonzero.default, aten.argwhere.default, aten.masked_select.default, aten._unique.default,
               aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default}
COPIES = {aten._to_copy.default, aten.copy_.default}
PROJECT = str(Path(__file__).parents[1])


class HostSyncs(TorchDispatchMode):
    """While active, records host-sync operations in `found`, as `(operation, where)` pairs.

    Args:
        allow: substrings of `file:function` (any frame of the call stack) whose syncs are not counted, for a
            sync this project cannot remove; each use says why.
    """

    def __init__(self, allow: tuple[str, ...] = ()):
        super().__init__()
        self.allow = allow
        self.found: list[tuple[str, str]] = []
        self._tolist = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _sync(func, args, kwargs)
        if name:
            self._record(name)
        return func(*args, **kwargs)

    def __enter__(self):
        self._tolist = original = torch.Tensor.tolist

        def tolist(tensor):
            self._record("Tensor.tolist")
            return original(tensor)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def _record(self, name: str) -> None:
        stack = [f for f in traceback.extract_stack() if f.filename != __file__]  # the counter's own frames aside
        if any(a in f"{frame.filename}:{frame.name}" for frame in stack for a in self.allow):
            return
        ours = [f for f in stack if f.filename.startswith(PROJECT) and "/site-packages/" not in f.filename]
        asked = [f for f in stack if f"{os.sep}torch{os.sep}" not in f.filename][-1:]  # torch's wrappers aside
        frames = ours[-1:] + [f for f in asked if f not in ours[-1:]]
        self.found.append((name, " -> ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames)))

    def report(self) -> str:
        """One line per sync: what, and where (this project's innermost frame -> the line that asked for it)."""
        return "host syncs:\n" + "\n".join(f"  {name} at {where}" for name, where in self.found)


def _sync(func, args, kwargs) -> str | None:
    """The name of the sync `func(*args, **kwargs)` would be, or None."""
    if func in READS or func in VALUE_SIZED:
        return str(func)
    if func is aten.index.Tensor and any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
        return "aten.index.Tensor with a boolean mask"
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "aten.repeat_interleave.Tensor without output_size"
    if func in COPIES:
        source, target = (args[0], kwargs.get("device")) if func is aten._to_copy.default else (args[1], args[0].device)
        target = source.device if target is None else torch.device(target)
        if source.device.type == "cpu" and target.type != "cpu" and not source.is_pinned():
            return f"{func} to {target.type} from pageable memory"
        if source.device.type not in ("cpu", "meta") and target.type == "cpu":
            return f"{func} from {source.device.type} to the host"
    return None


# ---- kernels that need a GPU, stood in by plain PyTorch that makes no host sync ------------------------------


def flash_varlen_stand_in(calls: list):
    """flash-attn's varlen kernel as transformers calls it (`flash_attention_2`): causal attention within each span
    of `cu_seq_lens_q` over the rows laid end to end (else within each row), by a mask, so that its own work reads
    nothing on the host. Records `(attention_mask, cu_seq_lens_q)` per call."""

    def attend(module, query, key, value, attention_mask, scaling=None, cu_seq_lens_q=None, **kwargs):
        calls.append((attention_mask, cu_seq_lens_q))
        rows, heads, length, dim = query.shape
        tokens = torch.arange(rows * length, device=query.device)
        bounds = (torch.arange(0, rows * length, length, device=query.device) if cu_seq_lens_q is None
                  else cu_seq_lens_q.long())
        document = torch.searchsorted(bounds, tokens, right=True)
        mask = (document[:, None] == document[None, :]) & (tokens[:, None] >= tokens[None, :])
        q, k, v = (x.transpose(0, 1).reshape(1, x.shape[1], rows * length, dim) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
        return out.reshape(heads, rows, length, dim).permute(1, 2, 0, 3), None

    return attend


def flex_stand_in(calls: list):
    """FlexAttention as transformers calls it (`flex_attention`), which has no CPU backward: the `BlockMask` it is
    given, made dense by its own mask function, then sdpa. Records the mask per call."""

    def attend(module, query, key, value, attention_mask, scaling=None, **kwargs):
        calls.append(attention_mask)
        rows, _, length, _ = query.shape
        dense = create_mask(attention_mask.mask_mod, rows, 1, length, length, device=query.device)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=dense, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    return attend
