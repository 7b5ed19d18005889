"""Two real gloo ranks: their steps that do not log wait for neither the GPU nor each other, and a stop signal that
reaches one rank between log steps still stops both at the same step."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from helpers import PORT_TAKEN, TINY

pytestmark = pytest.mark.dist



def spawn(function, tmp_path: Path, *args) -> list:
    """Run `function(rank, port, out, *args)` on 2 ranks; each rank's JSON result, in rank order."""
    from clustertrain.distributed.spawn import free_port

    for attempt in range(3):  # the free port can be taken before rank 0 binds it: then the run fails at once
        try:
            mp.start_processes(function, args=(free_port(), str(tmp_path), *args), nprocs=2, start_method="spawn")
            break
        except Exception as e:  # noqa: BLE001 - only a taken port is retried
            if PORT_TAKEN not in str(e) or attempt == 2:
                raise
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def _env(rank: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")


# ---- the trainer's steps ---------------------------------------------------------------------------------------


def _count_steps(rank: int, port: int, out: str, strategy: str) -> None:
    _env(rank, port)
    from host_syncs import HostSyncs

    import clustertrain.distributed.stop as stop
    from clustertrain.config.load import load_config
    from clustertrain.train.trainer import Trainer

    stop.AGREE_EVERY_S = 3600.0  # a slow machine may not make ranks agree between the steps counted below
    trainer = Trainer(load_config(None, [*TINY, f"train.run_dir={out}/run", "train.steps=8", "metrics.log_every=100",
                                         "checkpoint.every=0", "train.sample_tokens=0",
                                         f"parallel.strategy={strategy}"]))
    try:
        trainer.build()
        trainer.start(trainer.resume())
        trainer.train_steps(2)  # step 1 logs; step 2 times a step, for when ranks next agree on stopping
        with HostSyncs() as syncs:
            trainer.train_steps(3)  # steps 3-5 do not log
    finally:
        trainer.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(syncs.found))


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_steps_that_do_not_log_make_no_host_sync_on_two_ranks(tmp_path, strategy):
    for rank, found in enumerate(spawn(_count_steps, tmp_path, strategy)):
        assert found == [], f"rank {rank}: {found}"


# ---- stopping between log steps --------------------------------------------------------------------------------


def _agree(rank: int, port: int, out: str, signalled_rank: int, at: int, now_at: int | None) -> None:
    """Calls agreed() at boundaries 1..12, one (fake) second apart; `signalled_rank` gets SIGTERM before `at`."""
    _env(rank, port)
    import types

    import torch.distributed as dist

    import clustertrain.distributed.collectives as collectives
    import clustertrain.distributed.stop as stop

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    clock = [0.0]
    stop.time = types.SimpleNamespace(monotonic=lambda: clock[0])
    reduced = []
    reduce_values = collectives.reduce_values
    collectives.reduce_values = lambda *args, **kwargs: reduced.append(clock[0]) or reduce_values(*args, **kwargs)
    requests = stop.StopRequests(None, 0)
    answers = []
    try:
        for boundary in range(1, 13):
            clock[0] = float(boundary)
            if rank == signalled_rank and boundary == at:
                os.kill(os.getpid(), signal.SIGTERM)
            answers.append(requests.agreed(now=boundary == now_at))
    finally:
        requests.close()
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"answers": answers, "agreed_at": reduced}))


@pytest.mark.parametrize("signalled_rank, at, now_at, stops_at, agreements", [
    # agree at the first boundary, at the second (the first step timed), then every AGREE_EVERY_S = 5 steps of 1 s
    (1, 3, None, 7, [1, 2, 7]),
    (0, 3, 4, 4, [1, 2, 4]),  # a log step (now) agrees at once
], ids=["between-log-steps", "at-a-log-step"])
def test_a_signal_to_one_rank_stops_both_at_the_same_agreed_step(tmp_path, signalled_rank, at, now_at, stops_at,
                                                                 agreements):
    ranks = spawn(_agree, tmp_path, signalled_rank, at, now_at)
    for result in ranks:
        assert result["answers"].index("SIGTERM") + 1 == stops_at, result["answers"]
        assert set(result["answers"][: stops_at - 1]) == {None}
        assert result["agreed_at"][: len(agreements)] == agreements, "the agreements, not a collective per step"
