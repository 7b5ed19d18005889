"""A run's plan beside what the run measured: the plan (`clustertrain plan`) is made at the start, before the
process group (it needs a fake one), and written to <run_dir>/plan.json; at the end the run adds what it measured
and prints one line comparing them.

    planned = plan_run(resolved, per_node)                           # rank 0, before init_process_group
    files.write(files.plan, json.dumps({"plan": planned}))           # at start, once the run holds its lock
    watch = StateBytes(optimizers)                                   # counts the first step's gradients and states
    line = compare(files, planned, measured_records, baseline_bytes, watch)
"""

from __future__ import annotations

import json
import logging
import statistics
from typing import Any

import torch

from clustertrain.resolve.run import Resolved
from clustertrain.errors import one_line
from clustertrain.plan.fake import local_bytes, optimizer_state_bytes, state_bytes
from clustertrain.run_dir import RunDir

log = logging.getLogger(__name__)


def plan_run(run: Resolved, per_node: int) -> dict | None:
    """Plan the settled run on its world and device, `per_node` ranks a node; None if it could not be planned (the
    run goes on: a plan is advice). Nothing is written: the run directory is not the run's until it holds the lock."""
    from clustertrain.plan.plan import make_plan
    from clustertrain.plan.target import TargetRequest, target_for

    peak = run.config.metrics.peak_flops
    request = TargetRequest(world=run.layout.world_size, ranks_per_node=per_node,
                            peak_tflops=peak / 1e12 if peak else None)
    try:
        target = target_for(run.config, request, device_type=run.device_type or "cpu")
        return make_plan(target.config, run.layout, per_node, target.device).to_json()
    except Exception as e:  # noqa: BLE001 - a plan is advice: whatever stops it, the run trains
        log.warning("the run could not be planned (%s); it trains all the same", one_line(e)[:200])
        return None


class StateBytes:
    """This rank's gradient and optimizer-state bytes as the run holds them at its first optimizer step."""

    def __init__(self, parts: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]):
        self.parts = parts
        self.params, self.trainable, _ = state_bytes(parts)
        self.grads = self.optimizer = None
        self._hooks = [o.register_step_pre_hook(self._before) for o in optimizers]
        self._hooks += [o.register_step_post_hook(self._after) for o in optimizers]
        self._optimizers, self._stepped = optimizers, set()

    def _before(self, *_: Any) -> None:
        self.grads = sum(local_bytes(p.grad) for part in self.parts for p in part.parameters() if p.grad is not None)

    def _after(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self._stepped.add(id(optimizer))
        if len(self._stepped) == len(self._optimizers):  # every part's optimizer has its states
            self.optimizer = optimizer_state_bytes(self._optimizers)
            for hook in self._hooks:
                hook.remove()


def compare(files: RunDir, planned: dict, records: list[dict], baseline_bytes: float, state: StateBytes) -> str:
    """Add what the run measured to plan.json and say, in one line, how close the plan came."""
    steps = [r for r in records if r.get("tokens_per_s")][1:] or [r for r in records if r.get("tokens_per_s")]
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in steps) if steps else None
    peak = max((r["mem_gb"] for r in records if r.get("mem_gb") is not None), default=None)
    measured = {
        "peak_bytes": peak * 1e9 - baseline_bytes if peak is not None else None,
        "tokens_per_s": tokens_per_s,
        "step_s": planned["tokens_per_step"] / tokens_per_s if tokens_per_s else None,
        "params": state.params, "trainable": state.trainable, "grads": state.grads, "optimizer": state.optimizer,
    }
    files.write(files.plan, json.dumps({"plan": planned, "measured": measured}, indent=1))
    measured_gb = measured["peak_bytes"] / 1e9 if measured["peak_bytes"] is not None else None
    parts = [_beside("peak memory", planned["peak_bytes"] / 1e9, measured_gb, "GB"),
             _beside("step time", planned["step_s"], measured["step_s"], "s"),
             _beside("tokens/s", planned["tokens_per_s"], measured["tokens_per_s"], "")]
    return "plan vs measured: " + ", ".join(parts) + (" (CPU: measured is the peak resident memory above the "
                                                     "process's before the model)" if baseline_bytes else "")


def _beside(what: str, plan: float | None, measured: float | None, unit: str) -> str:
    def shown(value: float | None) -> str:
        return "—" if value is None else f"{value:,.3f} {unit}" if unit else f"{value:,.0f}"

    ratio = f" ({plan / measured:.2f})" if plan and measured else ""
    return f"{what} {shown(plan)} vs {shown(measured)}{ratio}"
