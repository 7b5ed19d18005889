"""Every collective site of a real run, watched: each tensor handed to a torch.distributed collective by
clustertrain comes from clustertrain.distributed.collectives (or is a parameter or gradient in pipeline P2P) and
lives on the device of its group's backend."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from helpers import TINY, run_ranks


pytestmark = pytest.mark.dist

WATCHED = ("all_reduce", "all_gather_object", "gather_object", "broadcast", "send", "recv", "batch_isend_irecv")
PACKAGE = str(Path(__file__).parents[2] / "clustertrain")


def _watch(calls: list) -> None:
    """Wrap torch.distributed's collectives: record the clustertrain caller, check each tensor's device."""
    import torch
    import torch.distributed as dist

    from clustertrain.distributed.collectives import group_device

    def wrap(name, original):
        def watched(*args, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(PACKAGE):
                caller = frame.f_back
                while caller.f_code.co_filename == frame.f_code.co_filename:  # reduce_values -> all_reduce
                    caller = caller.f_back
                site = f"{Path(caller.f_code.co_filename).stem}.{caller.f_code.co_name}"
                module = Path(frame.f_code.co_filename).relative_to(PACKAGE).as_posix()
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                group = kwargs.get("group")
                wrong = [str(t.device) for t in tensors if t.device != group_device(group)]
                calls.append({"name": name, "module": module, "site": site, "wrong_device": wrong})
            return original(*args, **kwargs)
        return watched

    for name in WATCHED:
        setattr(dist, name, wrap(name, getattr(dist, name)))


def _rank(rank: int, world: int, port: int, overrides: list[str], out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    calls: list = []
    _watch(calls)
    from clustertrain.config.load import load_config
    from clustertrain.train.trainer import Trainer

    Trainer(load_config(None, [*TINY, *overrides])).run()
    Path(out, f"calls-{rank}.json").write_text(json.dumps(calls))


def run_watched(tmp_path: Path, overrides: list[str]) -> list[dict]:
    run_ranks(_rank, tmp_path, overrides)
    return [c for r in range(2) for c in json.loads((tmp_path / f"calls-{r}.json").read_text())]


def test_every_collective_site_of_a_sharded_run_uses_the_group_device(tmp_path):
    calls = run_watched(tmp_path, ["parallel.strategy=zero3", "train.steps=4", "train.eval_every=2",
                                   "train.eval_batches=1", "checkpoint.every=2", "data.audit=true",
                                   "train.sample_tokens=4"])
    assert [c for c in calls if c["wrong_device"]] == []
    assert {c["module"] for c in calls} == {"distributed/collectives.py"}
    sites = {c["site"] for c in calls}
    for site in ["parts.lay_out_model", "step.count_tokens", "step.global_mean_loss", "batches.metrics",
                 "evaluate.evaluate", "stop.agreed", "loader.state_dict", "audit.record"]:
        assert site in sites, (site, sites)


def test_every_collective_site_of_a_pipeline_run_uses_the_group_device(tmp_path):
    calls = run_watched(tmp_path, ["parallel.pp=2", "train.steps=2", "train.eval_every=2", "train.eval_batches=1",
                                   "model.config.tie_word_embeddings=true"])
    assert [c for c in calls if c["wrong_device"]] == []
    p2p = {c["name"] for c in calls if c["module"] == "parallel/pp.py"}
    assert p2p == {"send", "recv", "batch_isend_irecv"}  # tied weights, then their gradients
    assert {c["module"] for c in calls} == {"distributed/collectives.py", "parallel/pp.py"}
    assert {"step.clip_grad_norm", "evaluate.evaluate", "step.global_mean_loss"} <= {c["site"] for c in calls}
