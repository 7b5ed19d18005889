"""tests/helpers.py holds what every run-level test relies on: that a run ended as its user would see it, and that
a command past its time leaves nothing running."""

from __future__ import annotations

import subprocess
import time

import pytest
import yaml
from forkserver import Forked
from helpers import _run_once, alive, check_ending, popen

from clustertrain.config.load import dump_config, load_config
from clustertrain.run_dir import RunDir
from clustertrain.train.status import write_status

SUMMARY = "run directory  /r\n         loss  6.250 at step 1 -> 5.948 at step 4\n       sample  def f(x)\n"


def ended(run_dir, code, stdout=SUMMARY, *overrides):
    """A run directory with its config.yaml, and the CompletedProcess of a run that exited `code`."""
    run_dir.mkdir(exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(load_config(None, ["train.sample_tokens=4", *overrides])))
    return subprocess.CompletedProcess(["clustertrain", "train"], code, stdout, "")


def test_a_finished_run_passes_and_each_way_of_ending_wrongly_fails(tmp_path):
    write_status(RunDir(tmp_path), "finished", step=4, total_steps=4)
    check_ending(tmp_path, ended(tmp_path, 0))
    with pytest.raises(AssertionError, match="exit 1"):
        check_ending(tmp_path, ended(tmp_path, 1), 0)
    with pytest.raises(AssertionError, match="no end-of-run sample"):
        check_ending(tmp_path, ended(tmp_path, 0, SUMMARY.replace("sample", "other")))
    with pytest.raises(AssertionError, match="the end-of-run sample failed"):
        check_ending(tmp_path, ended(tmp_path, 0, SUMMARY + "warning: the end-of-run sample failed (ValueError)\n"))
    check_ending(tmp_path, ended(tmp_path, 0, "no summary at all", "parallel.pp=2"))  # pipelined: no sample
    write_status(RunDir(tmp_path), "running", step=2, total_steps=4)
    with pytest.raises(AssertionError, match="expected 'finished'"):
        check_ending(tmp_path, ended(tmp_path, 0))


def test_stopped_preempted_failed_and_refused_runs_need_their_own_states(tmp_path):
    write_status(RunDir(tmp_path), "stopped", step=2, total_steps=4)
    check_ending(tmp_path, ended(tmp_path, 0, SUMMARY, "train.stop_after_steps=2"))
    with pytest.raises(AssertionError, match="expected 'finished'"):  # without stop_after_steps, a run goes on
        check_ending(tmp_path, ended(tmp_path, 0))
    write_status(RunDir(tmp_path), "preempted", step=2, total_steps=4)
    check_ending(tmp_path, ended(tmp_path, 75), 75)
    with pytest.raises(AssertionError, match="expected 'failed'"):
        check_ending(tmp_path, ended(tmp_path, 3), 3)
    write_status(RunDir(tmp_path), "failed", step=2, total_steps=4)
    check_ending(tmp_path, ended(tmp_path, 74), 74)
    check_ending(tmp_path, ended(tmp_path, 2), 2, state="failed")  # a user error after the start
    before = yaml.safe_load((tmp_path / "status.json").read_text())
    check_ending(tmp_path, ended(tmp_path, 2), 2, before=before)  # a refused start: status.json as it was
    with pytest.raises(AssertionError, match="a refused start changed status.json"):
        check_ending(tmp_path, ended(tmp_path, 2), 2, before=None)


def test_a_command_past_its_timeout_is_killed_with_every_process_it_started():
    # Two "ranks" in sessions of their own, without a parent-death signal: only the helper can kill them.
    code = ("import subprocess, sys, time\n"
            "ranks = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)"
            " for _ in range(2)]\n"
            "print(*(r.pid for r in ranks), flush=True)\n"
            "time.sleep(120)\n")
    with pytest.raises(AssertionError, match="ran past 3 s: killed it and every process it started") as error:
        _run_once(["-c", code], None, 3, None)
    ranks = [int(pid) for pid in str(error.value).splitlines()[1].split()]
    assert len(ranks) == 2
    deadline = time.monotonic() + 10
    while any(map(alive, ranks)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(alive, ranks))


@pytest.mark.parametrize("args", [["config", "show", "--set", "train.steps=7"], ["config", "show", "--set", "x.y=1"],
                                  ["train", "--set", "train.steps=-1"]], ids=["ok", "bad-key", "bad-value"])
def test_a_command_forked_by_the_server_ends_as_in_a_fresh_interpreter(tmp_path, args):
    forked = popen(["-m", "clustertrain", *args], cwd=tmp_path)
    fresh = popen(["-m", "clustertrain", *args], cwd=tmp_path, fresh=True)
    assert isinstance(forked, Forked) and not isinstance(fresh, Forked)
    assert forked.communicate(timeout=120) == fresh.communicate(timeout=120)
    assert forked.returncode == fresh.returncode == (0 if args[-1].endswith("7") else 2)
    assert list(tmp_path.iterdir()) == []  # both ran here and wrote nothing
