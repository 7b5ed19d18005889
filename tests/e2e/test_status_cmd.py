"""`clustertrain status RUN_DIR`: a hung run's state, heartbeats, slowest rank, stacks and Slurm retries, from the
files the watchdog and the job chain write (in-process through the CLI's main()); a real finished run; one line and
exit 2 for a directory that is no run."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from helpers import train

from clustertrain.cli import main
from clustertrain.cli.status_cmd import main_thread, read_heartbeats, slowest_rank
from clustertrain.run_dir import RunDir

WATCHDOG_STACKS = """rank 1 on node2 (pid 4242): 95 s in step 7 (limit 60 s)

Thread MainThread (most recent call last):
  File "/venv/clustertrain/cli/train_cmd.py", line 60, in _run
    summary = Trainer(config).run()
  File "/venv/clustertrain/train/trainer.py", line 223, in train_steps
    result = train_step(self.runner, self.optimizer, batch)
  File "/venv/clustertrain/data/loader.py", line 88, in next_batch
    time.sleep(600)
Thread clustertrain-watchdog (most recent call last):
  File "/venv/clustertrain/distributed/watchdog.py", line 110, in _watch
    self._beat("running")
"""
WAITING_STACKS = """rank 0 on node3 (pid 4240): 61 s in step 7 (limit 60 s)

Thread MainThread (most recent call last):
  File "/venv/clustertrain/train/trainer.py", line 223, in train_steps
    loss = count_tokens(batch)
  File "/venv/clustertrain/train/step.py", line 40, in count_tokens
    return all_reduce(total)
  File "/venv/torch/distributed/distributed_c10d.py", line 2501, in all_reduce
    work.wait()
Thread clustertrain-watchdog (most recent call last):
  File "/venv/clustertrain/distributed/watchdog.py", line 110, in _watch
    self._end_hung(why)
"""
CHAIN = [
    {"event": "submitted", "job_id": "7"},
    {"event": "started", "job_id": "7", "restart": 0, "nodes": "node1"},
    {"event": "ended", "job_id": "7", "restart": 0, "exit_code": 1, "outcome": "retried", "excluded": "node1"},
    {"event": "started", "job_id": "7", "restart": 1, "nodes": "node[2-3]"},
]


def beat(rank, host, step, age, **fields):
    now = time.time()
    return {"rank": rank, "host": host, "pid": 4240 + rank, "state": "running", "step": step, "phase": "step",
            "phase_started": now - age - 5, "time": now - age, "where": "clustertrain/train/trainer.py:223 in "
            "train_steps", "waiting": False, "step_s": 0.5, **fields}


@pytest.fixture
def hung_run(tmp_path):
    """A run directory as a 2-rank Slurm job leaves it when the watchdog ended it for rank 1's hang."""
    run = RunDir(tmp_path)
    run.write(run.status, json.dumps({
        "state": "hung", "time": time.time() - 3, "step": 7, "total_steps": 100, "stuck_ranks": [1],
        "stuck_hosts": ["node2"], "phase": "step", "slurm_job_id": "7", "slurm_restart": 1,
        "error": "hang: rank 1 (host node2, pid 4241) stopped beating 95 s ago, in step 7"}))
    run.write(run.heartbeat(0), json.dumps(beat(0, "node3", 7, 2, state="hung", waiting=True)))
    run.write(run.heartbeat(1), json.dumps(beat(1, "node2", 7, 95, period_s=10)))
    run.write(run.hang_report, json.dumps({
        "time": time.time(), "line": "hang: rank 1 (host node2, pid 4241) stopped beating 95 s ago, in step 7",
        "stuck_ranks": [1], "stuck_hosts": ["node2"], "phase": "step", "step": 7,
        "stacks": ["rank-00000.txt", "rank-00001.txt"], "reporter": 0}))
    run.write(run.hang_stacks(0), WAITING_STACKS)
    run.write(run.hang_stacks(1), WATCHDOG_STACKS)
    run.write(run.job_chain, "".join(json.dumps(e) + "\n" for e in CHAIN))
    return tmp_path


def test_a_hung_run_shows_the_stuck_rank_its_stack_and_the_retries(hung_run, capsys):
    assert main(["status", str(hung_run)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "state     hung at step 7/100 in step; stuck rank(s) 1 on node2 (3 s ago)" in out
    rank0 = next(line for line in lines if line.startswith("  0 "))
    assert rank0.split()[:4] == ["0", "node3", "hung", "7"] and "2 s ago" in rank0
    assert rank0.endswith("train_steps (waiting in a collective)")
    assert "no beat for 95 s" in next(line for line in lines if line.startswith("  1 "))
    assert "slowest   rank 1 on node2: step 7, phase step, no beat for 95 s" in out
    # The stuck rank's stack first: the watchdog's dump, main thread first, most recent call last.
    stacks = out[out.index(f"  {hung_run}/hang/rank-00001.txt"):]
    assert stacks.startswith(f"  {hung_run}/hang/rank-00001.txt: rank 1 on node2 (pid 4242): 95 s in step 7 "
                             "(limit 60 s)\n    Thread MainThread (most recent call last):\n      File")
    assert stacks.index("trainer.py\", line 223") < stacks.index("time.sleep(600)") < stacks.index("rank-00000.txt")
    assert "watchdog.py" not in stacks[:stacks.index("rank-00000.txt")]
    assert f"  {hung_run}/hang/rank-00000.txt: rank 0 on node3 (pid 4240): 61 s in step 7" in out
    assert "line 2501, in all_reduce" in out and "self._end_hung" not in out
    assert "jobs      1 restart(s), 1 failed start(s) in a row, excluded node1" in out
    retried = next(line for line in lines if " retried " in line)
    assert retried.split()[:2] == ["7", "0"] and retried.split()[-2:] == ["node1", "node1"]


def test_json_has_every_rank_the_slowest_the_hang_and_the_jobs(hung_run, capsys):
    assert main(["status", str(hung_run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["status"]["state"] == "hung" and report["status"]["stuck_ranks"] == [1]
    assert [(r["rank"], r["stale"]) for r in report["ranks"]] == [(0, False), (1, True)]
    assert report["slowest"]["rank"] == 1 and 94 < report["slowest"]["age_s"] < 120
    assert report["hang"]["report"]["stuck_hosts"] == ["node2"]
    assert report["hang"]["stacks"]["rank-00001.txt"]["lines"][-1] == "    time.sleep(600)"
    assert report["jobs"]["restarts"] == 1 and report["jobs"]["excluded"] == ["node1"]
    assert [row["state"] for row in report["jobs"]["chain"]] == ["retried", "?"]


def test_a_beat_is_stale_after_two_and_a_half_of_its_periods_unless_its_rank_stopped_beating(tmp_path):
    run = RunDir(tmp_path)
    for rank, (age, fields) in enumerate([(24, {}), (35, {}), (35, {"period_s": 20}), (500, {"state": "ended"}),
                                          (500, {"state": "hung"})]):
        run.write(run.heartbeat(rank), json.dumps(beat(rank, "node1", 3, age, **fields)))
    ranks, unreadable = read_heartbeats(run, time.time())
    assert [r["stale"] for r in ranks] == [False, True, False, False, False] and unreadable == []


def test_the_slowest_rank_is_the_lowest_step_then_the_oldest_beat():
    def ranks(*beats):
        return [{"rank": i, "step": step, "age_s": age} for i, (step, age) in enumerate(beats)]

    assert slowest_rank(ranks((9, 1), (7, 1), (8, 50)))["rank"] == 1
    assert slowest_rank(ranks((7, 1), (7, 30), (7, 2)))["rank"] == 1
    assert slowest_rank(ranks((3, 1), (None, 1)))["rank"] == 1  # no step yet: still starting
    assert slowest_rank([]) is None


def test_stacks_show_the_main_threads_innermost_lines():
    dump = main_thread(WATCHDOG_STACKS, count=2)
    assert dump["thread"] == "Thread MainThread (most recent call last):"
    assert dump["lines"] == ['  File "/venv/clustertrain/data/loader.py", line 88, in next_batch', "    time.sleep(600)"]
    assert dump["more"] == 4 and dump["why"].startswith("rank 1 on node2")
    assert main_thread("no thread here\nat all\n")["lines"] == ["at all"]


def test_unreadable_files_are_named_not_fatal(hung_run, capsys):
    run = RunDir(hung_run)
    run.heartbeat(1).write_text("{not json")
    run.write(run.heartbeat(2), json.dumps({"rank": "two"}))
    run.hang_report.write_text("[]")
    assert main(["status", str(hung_run)]) == 0
    out = capsys.readouterr().out
    assert "unreadable: rank-00001.json, rank-00002.json" in out
    assert "hang      stacks in hang/ (no report.json)" in out and "rank-00000.txt" in out


def test_a_finished_run(tmp_path, capsys):
    train(tmp_path, "train.steps=3")
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "state     finished at step 3/3" in out
    assert "hang" not in out and "jobs" not in out
    if RunDir(tmp_path).heartbeat(0).exists():  # the watchdog's last beat
        row = next(line for line in out.splitlines() if line.startswith("  0 "))
        assert row.split()[2:4] == ["ended", "3"]
    report = json.loads(subprocess.run([sys.executable, "-m", "clustertrain", "status", str(tmp_path), "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    assert report["status"]["state"] == "finished" and report["hang"] is None and report["jobs"] is None


def test_a_directory_that_is_no_run_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["status", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path} is not a run directory: it has no status.json, "
                                       "heartbeats/, slurm/jobs.jsonl, checkpoints/ or config.yaml\n")
    result = subprocess.run([sys.executable, "-m", "clustertrain", "status", str(tmp_path / "missing")],
                            capture_output=True, text=True)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"error: {tmp_path / 'missing'}: no such directory; give a run directory (train.run_dir)\n"


def test_status_imports_no_torch(hung_run):
    """A login node's command: torch takes seconds to import, and may not be installed there."""
    code = ("import sys; from clustertrain.cli import main; code = main(['status', sys.argv[1]]); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules)); sys.exit(code)")
    for run_dir, expect in ((hung_run, 0), (hung_run / "missing", 2)):  # an error's line too
        result = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True)
        assert result.returncode == expect, result.stderr
        assert result.stdout.splitlines()[-1] == "[]"
