"""Rank 0 goes first while the other ranks wait on the store (clustertrain/distributed/rank0.py): real 2-rank gloo
process groups whose collective timeout is 2 s, and a rank 0 that is slower than it, fails, dies or freezes."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest

from clustertrain.distributed.spawn import free_port

pytestmark = pytest.mark.dist
TIMEOUT_S = 2  # the process group's (and so the store's) timeout: what a barrier would have waited at most
WHAT = "building the cache"


def _rank(rank: int, port: int, scenario: str, tmp: str, results, finished, store_in_parent: bool) -> None:
    """One rank: join the group, run `scenario`, report ("ok", value) or (error class, message)."""
    os.environ.update(OMP_NUM_THREADS="1")
    import torch.distributed as dist

    from clustertrain.distributed import failures, rank0

    rank0.PROGRESS_S, failures.SHOW_WAIT_S = 1.0, 0.5
    timeout = timedelta(seconds=TIMEOUT_S)
    if store_in_parent:  # as under torchrun, whose agent hosts the store: it outlives a frozen rank 0
        store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    else:  # as under --nproc and srun: rank 0 hosts the store
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timeout)
    try:
        results.put((rank, "ok", SCENARIOS[scenario](rank, Path(tmp), rank0.rank0_first)))
    except Exception as e:
        # what Trainer.run does with an error: publish it; the error the run reports is the first of any rank's
        first = failures.first_failure(e)
        results.put((rank, type(e).__name__, str(e), (first.rank, first.kind, first.message)))
        failures.let_peers_report()
    if rank == 0:
        finished.wait(30)  # keep the store (hosted here) up until the other rank has reported
    dist.destroy_process_group()


def _slow(rank: int, tmp: Path, rank0_first) -> str:
    def build() -> str:
        if rank == 0:
            time.sleep(2.5 * TIMEOUT_S)  # training a tokenizer on a big corpus, past the collective timeout
            (tmp / "cache").write_text("filled by rank 0")
        return (tmp / "cache").read_text()

    first = rank0_first(WHAT, build)
    return first + " | " + rank0_first("a second step", lambda: f"rank {rank}")  # keys differ per call


def _raises(rank: int, tmp: Path, rank0_first) -> str:
    from clustertrain.errors import DataError

    def build() -> str:
        raise DataError("data/a.jsonl:3: malformed JSON")

    return rank0_first(WHAT, build)


def _fails_before(rank: int, tmp: Path, rank0_first) -> str:
    from clustertrain.errors import DataError

    if rank == 0:  # rank 0 never gets to rank0_first: its run lock is held, say
        raise DataError("train.run_dir: runs/x is in use by another run")
    return rank0_first(WHAT, lambda: "built")


def _dies(rank: int, tmp: Path, rank0_first) -> str:
    def build() -> str:
        if rank == 0:
            os._exit(9)  # the OOM killer, with the store rank 0 hosts
        return "built"

    return rank0_first(WHAT, build)


def _freezes(rank: int, tmp: Path, rank0_first) -> str:
    def build() -> str:
        if rank == 0:
            time.sleep(0.5)  # a few heartbeats first
            os.kill(os.getpid(), signal.SIGSTOP)  # hung for good: no heartbeat, while the store stays up
        return "built"

    return rank0_first(WHAT, build)


SCENARIOS = {"slow": _slow, "raises": _raises, "fails_before": _fails_before, "dies": _dies, "freezes": _freezes}


def run_ranks(scenario: str, tmp: Path, store_in_parent: bool = False, reporting: int = 2) -> dict[int, tuple]:
    """Run `scenario` on 2 real ranks until `reporting` of them (rank 1 if one) reported; the reports by rank."""
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    results, finished, port = ctx.Queue(), ctx.Event(), free_port()
    server = (dist.TCPStore("127.0.0.1", port, 3, True, timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
              if store_in_parent else None)
    procs = [ctx.Process(target=_rank, args=(r, port, scenario, str(tmp), results, finished, store_in_parent))
             for r in range(2)]
    for p in procs:
        p.start()
    reports: dict[int, tuple] = {}
    try:
        deadline = time.monotonic() + 60
        while len(reports) < reporting and time.monotonic() < deadline and any(p.is_alive() for p in procs):
            try:
                report = results.get(timeout=0.2)
            except queue.Empty:
                continue
            reports[report[0]] = report[1:]
    finally:
        finished.set()
        for rank, p in enumerate(procs):
            if rank not in reports:  # dead, or frozen for good
                p.kill()
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        del server
    return reports


def test_a_rank_0_slower_than_the_collective_timeout_is_waited_for(tmp_path, capfd):
    # a barrier here ended rank 1 after TIMEOUT_S ("Timed out waiting 2000ms for recv operation to complete")
    reports = run_ranks("slow", tmp_path)
    assert reports == {0: ("ok", "filled by rank 0 | rank 0"), 1: ("ok", "filled by rank 0 | rank 1")}, reports
    output = capfd.readouterr().out
    assert "building the cache on rank 0: 1 s so far; the other rank waits for it" in output, output
    assert "a second step" not in output  # a quick build says nothing


def test_rank_0s_error_is_the_one_the_others_report(tmp_path, capfd):
    reports = run_ranks("raises", tmp_path)
    rank0_error = (0, "DataError", "data/a.jsonl:3: malformed JSON")
    assert reports[0] == ("DataError", "data/a.jsonl:3: malformed JSON", rank0_error)
    # rank 1 does not build after rank 0 failed, nor time out: one line naming rank 0's error, and the error its
    # run reports (as PeerFailed, whose line is rank 0's) is rank 0's
    assert reports[1] == ("WaitFailed", "rank 0 failed while building the cache: DataError: data/a.jsonl:3: "
                                        "malformed JSON", rank0_error), reports
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == ["error: data/a.jsonl:3: malformed JSON"]  # shown once, by rank 0


def test_a_rank_0_that_fails_before_it_gets_there_ends_the_wait(tmp_path):
    reports = run_ranks("fails_before", tmp_path)
    rank0_error = (0, "DataError", "train.run_dir: runs/x is in use by another run")
    assert reports[1] == ("WaitFailed", "rank 0 failed while this rank waited for rank 0 (building the cache): "
                                        "DataError: train.run_dir: runs/x is in use by another run", rank0_error)


def test_a_rank_0_that_dies_ends_the_wait_with_one_line(tmp_path):
    reports = run_ranks("dies", tmp_path, reporting=1)
    assert list(reports) == [1]
    kind, message, _ = reports[1]
    assert kind == "WaitFailed" and message.startswith(
        "rank 0 stopped answering while building the cache: the process group's store is gone ("), message
    assert "\n" not in message


def test_a_frozen_rank_0_ends_the_wait_after_the_timeout(tmp_path):
    start = time.monotonic()
    reports = run_ranks("freezes", tmp_path, store_in_parent=True, reporting=1)
    assert reports[1][:2] == ("WaitFailed", f"rank 0 gave no sign of life for {TIMEOUT_S} s "
                                            "(parallel.timeout_minutes) while building the cache: it hangs or was "
                                            "stopped; see its output"), reports
    assert time.monotonic() - start < 30
