"""`clustertrain status RUN_DIR`: a hung run's state, heartbeats, slowest rank, stacks and Slurm retries, from the
files the watchdog and the job chain write (in-process through the CLI's main()); a real finished run; one line and
exit 2 for a directory that is no run."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import unicodedata

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
    assert [r["stale"] for r in ranks] == [False, True, False, False, False] and unreadable == {}


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
    assert main(["status", str(hung_run)]) == 1  # the rest is shown; the exit code says something is damaged
    out = capsys.readouterr().out
    assert f"damaged   {hung_run}/heartbeats/rank-00001.json: not valid JSON (Expecting property name enclosed in " \
        "double quotes at line 1 column 2)\n" in out
    assert f"          {hung_run}/heartbeats/rank-00002.json: not a heartbeat (no whole-number \"rank\")\n" in out
    assert f"          {hung_run}/hang/report.json: not a JSON object (got a list)\n" in out
    assert "hang      stacks in hang/ (no readable report.json)" in out and "rank-00000.txt" in out
    assert "state     hung at step 7/100" in out and "  0 " in out  # what could be read is all there


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


# ---- hostile run files: never blocking, bounded, named when damaged, nothing a terminal would obey -------------------
def status_cli(run_dir, *args, memory=1 << 30):
    """`clustertrain status RUN_DIR` in a fresh process of at most `memory` bytes: a read that blocks is a failure
    after 30 s, not a test that hangs, and one that grows without end fails at once instead of eating the machine."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    try:
        return subprocess.run([sys.executable, "-m", "clustertrain", "status", str(run_dir), *args], timeout=30,
                              preexec_fn=limit, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        raise AssertionError("status blocked for 30 s on a run's file") from None


def test_fifos_and_a_link_to_dev_zero_never_block_or_fill_memory(hung_run):
    run = RunDir(hung_run)
    (run.checkpoints / "step-0000004").mkdir(parents=True)
    for path in (run.status, run.heartbeat(1), run.hang_stacks(1)):
        path.unlink()
        os.mkfifo(path)
    run.heartbeat(0).unlink()
    run.heartbeat(0).symlink_to("/dev/zero")
    result = status_cli(hung_run)
    assert result.returncode == 1 and result.stderr == "", result.stderr
    out = result.stdout
    assert "state     unknown: status.json is damaged (below); checkpoints up to step 4 (1 in all)\n" in out
    assert (f"damaged   {hung_run}/status.json: a FIFO, not a regular file\n"
            f"          {hung_run}/heartbeats/rank-00000.json: a character device, not a regular file\n"
            f"          {hung_run}/heartbeats/rank-00001.json: a FIFO, not a regular file\n"
            f"          {hung_run}/hang/rank-00001.txt: a FIFO, not a regular file\n") in out
    assert f"  {hung_run}/hang/rank-00001.txt: unreadable: a FIFO, not a regular file\n" in out
    assert "line 2501, in all_reduce" in out  # rank 0's stack, still shown
    report = json.loads(status_cli(hung_run, "--json").stdout)
    assert report["damaged"]["heartbeats/rank-00000.json"] == "a character device, not a regular file"
    assert report["unreadable_heartbeats"] == ["rank-00000.json", "rank-00001.json"]
    run.job_chain.unlink()
    os.mkfifo(run.job_chain)  # the chain is the command's to read whole: one line, as for a malformed chain
    result = status_cli(hung_run)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"error: {run.job_chain}: cannot read it (a FIFO, not a regular file)\n"


def loop(path):
    path.symlink_to(path.name + ".other")
    path.with_name(path.name + ".other").symlink_to(path.name)


DAMAGED_STATUS = {
    "cut short": (lambda p: p.write_text('{"state": "running", "step": 3, "ti'),
                  "not valid JSON (Unterminated string starting at line 1 column 33)"),
    "a JSON list": (lambda p: p.write_text('["running"]'), "not a JSON object (got a list)"),
    "no state": (lambda p: p.write_text('{"step": 3}'), 'not a status (no "state" string)'),
    "not UTF-8": (lambda p: p.write_bytes(b'{"state": "\xff"}'), "not valid JSON ('utf-8' codec can't decode"),
    "a directory": (lambda p: p.mkdir(), "a directory, not a regular file"),
    "a symlink loop": (loop, "Too many levels of symbolic links"),
    "50 MB": (lambda p: os.truncate(p.write_text("{") and p, 50 << 20), "larger than 1,048,576 bytes (52,428,800)"),
}


@pytest.mark.parametrize("damage, why", DAMAGED_STATUS.values(), ids=DAMAGED_STATUS.keys())
def test_a_damaged_status_is_named_and_a_run_with_checkpoints_is_never_not_started(tmp_path, capsys, damage, why):
    run = RunDir(tmp_path)
    for step in (2, 4):
        (run.checkpoints / f"step-{step:07d}").mkdir(parents=True)
    damage(run.status)
    assert main(["status", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "state     unknown: status.json is damaged (below); checkpoints up to step 4 (2 in all)\n" in out
    assert f"damaged   {tmp_path}/status.json: {why}" in out
    assert "not started" not in out


def test_without_status_json_a_run_that_has_trained_says_so(tmp_path, capsys):
    run = RunDir(tmp_path)
    (run.checkpoints / "step-0000006").mkdir(parents=True)
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "state     no status.json; checkpoints up to step 6 (1 in all): the run has trained\n" in out
    for path in run.checkpoints.iterdir():
        path.rmdir()
    run.config.write_text("train: {}\n")
    assert main(["status", str(tmp_path)]) == 0
    assert "state     no status.json yet (not started)\n" in capsys.readouterr().out


ESCAPES = "\x1b[2J\x1b]0;owned\x07\x9b31m\u202e"  # clear the screen, retitle the window, a C1 CSI, a bidi override


def test_no_control_character_reaches_the_terminal_and_long_text_is_cut_to_a_page(hung_run):
    run = RunDir(hung_run)
    error = "\n".join(f"line {i} {ESCAPES} " + "x" * 2000 for i in range(300))  # 600 KB: under the size cap
    run.write(run.status, json.dumps({"state": "failed", "step": 7, "total_steps": 100, "error": error}))
    run.write(run.heartbeat(0), json.dumps(beat(0, "node3" + ESCAPES + "\r\b" + "h" * 5000, 7, 2, where="w" * 100_000)))
    run.write(run.hang_stacks(1), WATCHDOG_STACKS.replace("time.sleep(600)", ESCAPES + "s" * 900_000))
    run.write(run.job_chain, "".join(json.dumps({**e, "nodes": "node" + ESCAPES} if "nodes" in e else e) + "\n"
                                     for e in CHAIN))
    result = status_cli(hung_run)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    shown = [c for c in out if c != "\n" and (unicodedata.category(c) in ("Cc", "Cf") or c in "\u2028\u2029")]
    assert shown == [], shown
    assert "failed at step 7/100: line 0 \\x1b[2J\\x1b]0;owned\\x07\\x9b31m\\u202e xxx" in out  # seen, not obeyed
    assert "node\\x1b[2J" in out and "node3\\x1b[2J\\x1b]0;owned\\x07\\x9b31m\\u202e\\r\\x08hh" in out
    lines = out.splitlines()
    assert len(lines) < 60 and max(map(len, lines)) < 700
    assert f"          ... (cut; see {hung_run}/status.json)" in out
    assert "line 11 " in out and "line 12 " not in out  # 12 lines of the error
    report = json.loads(status_cli(hung_run, "--json").stdout)  # JSON escapes them; the data stays whole
    assert report["status"]["error"] == error and "\x1b" not in status_cli(hung_run, "--json").stdout
