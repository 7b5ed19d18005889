"""Which rank's error is reported and who shows it, over an in-memory store standing in for the process group's
(the real thing, with 2 ranks and gloo, is tests/distributed/test_rank_errors.py)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from clustertrain.distributed import failures
from clustertrain.distributed.failures import PeerFailed, RankFailure
from clustertrain.errors import DataError

GLOO = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242\nmore")


@pytest.fixture
def store(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setattr(failures, "_store", lambda: store)
    monkeypatch.setattr(failures, "SHOW_WAIT_S", 0.2)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    yield store
    failures._lingering = None


def fail_on(monkeypatch, rank: int, error: BaseException) -> RankFailure:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    return failures.first_failure(error)


def test_a_peers_user_error_beats_rank_0s_dropped_connection_and_is_shown_once(store, monkeypatch, capsys):
    bad_line = DataError("data/a.jsonl:7: malformed JSON")
    on_1 = fail_on(monkeypatch, 1, bad_line)  # rank 0 is blocked in a collective: rank 1 shows its own
    assert on_1.rank == 1 and on_1.shown and bad_line.shown
    on_0 = fail_on(monkeypatch, 0, GLOO)  # the collective broke once rank 1 left
    assert (on_0.rank, on_0.kind, on_0.exit_code, on_0.shown) == (1, "DataError", 2, True)
    assert str(on_0) == "DataError: data/a.jsonl:7: malformed JSON (rank 1)"  # for status.json
    assert capsys.readouterr().err == "error: data/a.jsonl:7: malformed JSON\n"
    assert PeerFailed(on_0).shown and PeerFailed(on_0).exit_code == 2


def test_rank_0s_user_error_leaves_the_peer_whose_collective_it_broke_quiet(store, monkeypatch, capsys):
    bad_line = DataError("data/a.jsonl:3: malformed JSON")
    on_0 = fail_on(monkeypatch, 0, bad_line)
    assert on_0.rank == 0 and bad_line.shown
    on_1 = fail_on(monkeypatch, 1, GLOO)
    assert (on_1.rank, on_1.user, on_1.shown) == (0, True, True)  # rank 1 raises PeerFailed: nothing printed
    assert capsys.readouterr().err == "error: data/a.jsonl:3: malformed JSON\n"
    failures.let_peers_report()  # every rank has published: no wait


def test_another_ranks_crash_is_named_by_rank_0_under_its_traceback(store, monkeypatch, capsys):
    fail_on(monkeypatch, 1, ValueError("a bug"))  # its traceback is printed by Python on rank 1
    on_0 = fail_on(monkeypatch, 0, GLOO)
    assert (on_0.rank, on_0.kind, on_0.exit_code) == (1, "ValueError", 1)
    assert capsys.readouterr().err == ("error: rank 1 failed first with ValueError: a bug (its traceback is in that "
                                       "rank's output)\n")


def test_rank_0s_own_crash_is_its_traceback_and_peers_keep_quiet(store, monkeypatch, capsys):
    crash = RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
    on_0 = fail_on(monkeypatch, 0, crash)  # no peer publishes within SHOW_WAIT_S: rank 0's own error
    assert (on_0.rank, on_0.message, on_0.shown) == (0, "CUDA error: an illegal memory access was encountered", False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_killed_without_a_word_is_one_line_of_rank_0_and_no_traceback(store, monkeypatch, capsys, world):
    """Rank 1 was killed (SIGKILL, the OOM killer): it publishes nothing; the others see only a broken connection.
    The launcher names the killed rank; rank 0 says it lost a rank in one line, any other rank stays quiet."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    if world == 3:
        on_2 = fail_on(monkeypatch, 2, RuntimeError("[pair.cc:537] Read error: Connection reset by peer. GLHF"))
        assert (on_2.rank, on_2.shown) == (failures.VANISHED, True)  # PeerFailed, shown: rank 2 prints nothing
        assert capsys.readouterr().err == ""
    on_0 = fail_on(monkeypatch, 0, GLOO)
    assert (on_0.rank, on_0.user, on_0.shown, on_0.exit_code) == (failures.VANISHED, False, True, 1)
    assert PeerFailed(on_0).shown  # the trainer raises it: the CLI prints nothing more, and no traceback
    assert capsys.readouterr().err == ("error: rank 0 lost its connection to another rank, which stopped without "
                                       "reporting an error (killed? out of memory?); its launcher's output names it\n")
    assert str(on_0) == on_0.line()  # status.json: the terminal's line, without "(rank -1)" or gloo's error type


def test_a_user_error_that_a_peer_showed_first_is_the_one_recorded(store, monkeypatch, capsys):
    fail_on(monkeypatch, 1, DataError("b.jsonl:1: malformed JSON"))  # waited for rank 0 in vain, showed it
    late = fail_on(monkeypatch, 0, DataError("a.jsonl:9: malformed JSON"))  # rank 0 meets its own bad line later
    assert (late.rank, late.message) == (1, "b.jsonl:1: malformed JSON")
    assert capsys.readouterr().err == "error: b.jsonl:1: malformed JSON\n"
