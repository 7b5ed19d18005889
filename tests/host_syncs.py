"""Count the operations that make the host wait for the GPU: none may run in a training step that does not log.

    with HostSyncs() as syncs:
        trainer.train_steps(2)
    assert syncs.found == [], syncs.report()

A CUDA kernel launch returns at once; the host runs ahead and queues the next ones. These operations stop it
until the GPU has caught up (or, for a collective, until the slowest rank has), so the queue drains and the
GPU idles while the host prepares what comes next. `HostSyncs` (a TorchDispatchMode) records, with the Python
line that asked for it:

- a read of a tensor's value by the host: `aten._local_scalar_dense` (`.item()`, `bool(t)`, `int(t)`,
  `float(t)`, `if t:`), `aten.is_nonzero`, `aten.equal`, and `Tensor.tolist()` (which dispatches no aten op);
- an output whose size depends on the values: `aten.nonzero` (and `argwhere`, `torch.where(cond)`),
  `aten.masked_select`, indexing with a boolean mask (`aten.index` with a bool index), `aten.unique*`,
  `aten.repeat_interleave` without `output_size`;
- a copy from a CPU tensor in pageable (not pinned) memory to another device (`aten._to_copy`, `aten.copy_`),
  which CUDA performs synchronously even when asked for `non_blocking`, and a copy from a device back to the CPU;
- a collective waited for on the host (`Work.wait()`, which `dist.all_reduce` and its kin call unless given
  `async_op=True`) on a gloo group, when a test names the group (`watch_group`): on an NCCL group the wait only
  orders the GPU streams, but a gloo side group's wait is a CPU barrier across every rank.

No GPU is here: tensors on the CPU stand in for the GPU's, so each operation counts whatever its tensors'
device. A host-side tensor that is meant to be read by the host (a CPU-only torch counter inside the optimizer,
say) would count too: name such a call site in `allow` (a substring of its `file:function`).
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
DYNAMIC_SHAPES = {aten.nonzero.default, aten.masked_select.default, aten.argwhere.default, aten._unique.default,
                  aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default}
COPIES = {aten._to_copy.default, aten.copy_.default}


class HostSyncs(TorchDispatchMode):
    """Records host-sync operations while active; `found` lists `(operation, where)` pairs.

    Args:
        allow: call sites (substrings of `file:function` of any frame on the stack) whose syncs are not counted.
    """

    def __init__(self, allow: Iterable[str] = ()):
        super().__init__()
        self.allow = tuple(allow)
        self.found: list[tuple[str, str]] = []
        self._saved: list[tuple[object, str, object]] = []
        self._groups: set = set()

    # ---- what counts ---------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = self._sync(func, args, kwargs)
        if name:
            self._record(name)
        return func(*args, **kwargs)

    def _sync(self, func, args, kwargs) -> str | None:
        if func in READS or func in DYNAMIC_SHAPES:
            return str(func)
        if func is aten.index.Tensor and any(
                i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            return "aten.index.Tensor (boolean mask)"
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            return "aten.repeat_interleave.Tensor (no output_size)"
        if func in COPIES:
            source, target = (args[0], kwargs.get("device")) if func is aten._to_copy.default else (args[1], args[0].device)
            target = torch.device(target) if target is not None else source.device
            if source.device.type == "cpu" and target.type != "cpu" and not source.is_pinned():
                return f"{func} from pageable memory to {target.type}"
            if source.device.type != "cpu" and target.type == "cpu":
                return f"{func} from {source.device.type} to the host"
        return None

    def _record(self, name: str) -> None:
        stack = traceback.extract_stack()[:-3]
        if any(a in f"{frame.filename}:{frame.name}" for frame in stack for a in self.allow):
            return
        ours = [f for f in stack if "/clustertrain/" in f.filename or "/tests/" in f.filename]
        where = [ours[-1]] if ours else []
        if stack[-1] not in where:
            where.append(stack[-1])  # the library line that asked, under ours
        self.found.append((name, " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
                                             for f in reversed(where))))

    def watch_group(self, group: dist.ProcessGroup) -> None:
        """Count host waits on collectives of `group` (a gloo group: its waits are CPU barriers)."""
        self._groups.add(group)

    # ---- Tensor.tolist and Work.wait do not dispatch: wrap them while the mode is on ------------------------
    def __enter__(self):
        counter = self

        def tolist(tensor, _original=torch.Tensor.tolist):
            counter._record("Tensor.tolist")
            return _original(tensor)

        self._patch(torch.Tensor, "tolist", tolist)
        if dist.is_available():
            self._patch_collectives()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for owner, name, original in reversed(self._saved):
                setattr(owner, name, original)
            self._saved.clear()

    def _patch(self, owner: object, name: str, replacement: object) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def _patch_collectives(self) -> None:
        """A blocking collective on a watched group counts (an `async_op=True` one counts when waited)."""
        import torch.distributed.distributed_c10d as c10d

        counter = self
        for name in ("all_reduce", "all_gather", "broadcast", "reduce", "all_gather_into_tensor",
                     "reduce_scatter_tensor", "barrier", "all_gather_object", "broadcast_object_list"):
            original = getattr(c10d, name)

            def blocking(*args, _original=original, _name=name, **kwargs):
                group = kwargs.get("group")
                group = dist.group.WORLD if group is None else group
                if group in counter._groups and not kwargs.get("async_op"):
                    counter._record(f"dist.{_name} (host wait on a gloo group)")
                work = _original(*args, **kwargs)
                return _WaitRecorder(work, counter, _name) if kwargs.get("async_op") and group in counter._groups \
                    else work

            self._patch(c10d, name, blocking)
            self._patch(dist, name, blocking)

    # ---- reporting -----------------------------------------------------------------------------------------
    def report(self) -> str:
        return "host syncs:\n" + "\n".join(f"  {name} at {where}" for name, where in self.found)


class _WaitRecorder:
    """An async collective's Work: `wait()` counts unless the work has completed already."""

    def __init__(self, work, counter: HostSyncs, name: str):
        self._work, self._counter, self._name = work, counter, name

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self, *args, **kwargs):
        if not self._work.is_completed():
            self._counter._record(f"dist.{self._name} wait (host wait on a gloo group)")
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)
