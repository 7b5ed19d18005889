"""A job whose run failed before its first step is retried (slurm.max_start_retries), a hung run requeued, each off
the nodes the doctor or the watchdog named: the decision, the count, and what job-end asks of a fake Slurm."""

from __future__ import annotations

import json
import os
import signal

import pytest

from clustertrain.errors import USER_ERROR_NOTE, DataError, note_user_error
from clustertrain.launch.jobs import (decide, doctor_bad_hosts, excluded_nodes, job_end, job_start, read_chain,
                                      record, start_retries)
from clustertrain.run_dir import RunDir


def status(state, job="7", restart=0, **fields):
    return {"state": state, "slurm_job_id": job, "slurm_restart": restart, "step": 40, **fields}


HUNG = status("hung", error="rank 1 (host node2) is stuck in step 41", stuck_ranks=[1], stuck_hosts=["node2"],
              phase="step")


@pytest.mark.parametrize("run_status, exit_code, retries, restarts, on_stop, outcome, exclude", [
    (None, 1, 0, 0, "requeue", "retry", ("node3",)),  # died before the trainer wrote its status
    (None, 137, 1, 1, "dependency", "retry", ("node3",)),  # a rank killed at rendezvous
    (status("running", job="6"), 1, 0, 0, "requeue", "retry", ("node3",)),  # the status is an older job's
    (None, 2, 0, 0, "requeue", "failed", ()),  # exit 2: the user's error (bad config, missing file)
    (None, 1, 2, 2, "requeue", "gave-up", ()),  # slurm.max_start_retries = 2 reached
    (None, 1, 0, 3, "requeue", "gave-up", ()),  # slurm.max_restarts = 3 reached
    (None, 1, 0, 0, "none", "stopped", ()),
    (status("running"), 1, 0, 0, "requeue", "failed", ()),  # started, then crashed: an error of its own
    (status("failed", error="ValueError: x"), 1, 0, 0, "requeue", "failed", ()),
    (status("failed", error="DistBackendError: x", before_start=True), 1, 0, 0, "requeue", "retry", ("node3",)),
    (None, 76, 0, 0, "requeue", "requeue", ("node3",)),  # the watchdog's exit code, its status.json lost
    (HUNG, 76, 0, 0, "requeue", "requeue", ("node2", "node3")),  # the watchdog's hang: off its stuck host
    (HUNG, 76, 0, 3, "requeue", "gave-up", ()),  # counted against slurm.max_restarts
    (HUNG, 76, 0, 0, "none", "stopped", ()),
])
def test_start_failures_and_hangs(run_status, exit_code, retries, restarts, on_stop, outcome, exclude):
    decision = decide(run_status, exit_code, False, "7", 0, restarts, 3, on_stop, start_retries=retries,
                      max_start_retries=2, bad_hosts=["node3"])
    assert (decision.outcome, decision.exclude) == (outcome, exclude), decision.message


@pytest.mark.parametrize("run_status, exit_code", [
    (None, 143),  # srun killed the other ranks once the one with the error exited 2
    (None, 1),  # torchrun's agent exits 1 for a worker's 2
    (HUNG, 76),
])
def test_a_noted_user_error_is_never_retried(run_status, exit_code):
    decision = decide(run_status, exit_code, False, "7", 0, 0, 3, "requeue", max_start_retries=2,
                      user_error="data source 'x.jsonl': no such file")
    assert decision.outcome == "failed" and "x.jsonl" in decision.message and "not requeued" in decision.message


def test_job_end_reads_the_user_error_a_rank_noted_and_job_start_clears_it(tmp_path, slurm):
    note = RunDir(tmp_path).user_error_note
    record(RunDir(tmp_path), "submitted", job_id="7")
    assert job_start(RunDir(tmp_path), 3, env={"SLURM_JOB_ID": "7"}) == 0
    note_user_error(DataError("data source '/no/such.jsonl': no such file"), env={USER_ERROR_NOTE: str(note)})
    assert job_end(RunDir(tmp_path), 143, False, "requeue", 3, 2, env={"SLURM_JOB_ID": "7"}) == 143
    assert read_chain(RunDir(tmp_path))[-1]["outcome"] == "failed" and not slurm.exists()  # no scontrol call
    job_start(RunDir(tmp_path), 3, env={"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"})  # the next job starts clean
    assert not note.exists()


def test_no_start_retries_unless_asked():
    assert decide(None, 1, False, "7", 0, 0, 3, "requeue").outcome == "failed"


def test_messages_say_why_and_how_often():
    retry = decide(None, 1, False, "7", 0, 0, 3, "requeue", start_retries=1, max_start_retries=2)
    assert retry.message == ("the run failed before its first step (exit code 1, no status.json of this job); "
                             "retry 2 of at most 2 (slurm.max_start_retries)")
    gave_up = decide(None, 1, False, "7", 0, 0, 3, "requeue", start_retries=2, max_start_retries=2)
    assert gave_up.message.endswith("not retried: 2 failed start(s) in a row reached slurm.max_start_retries = 2")
    hung = decide(HUNG, 76, False, "7", 0, 0, 3, "requeue")
    assert hung.message == ("the run hung at step 40 (rank 1 (host node2) is stuck in step 41); "
                            "requeue 1 of at most 3")
    assert hung.named_by == "the hang watchdog"


def test_start_retries_count_the_failed_starts_in_a_row(tmp_path):
    def chain(*outcomes):
        events = [{"event": "submitted", "job_id": "7"}]
        for outcome in outcomes:
            events += [{"event": "started", "job_id": "7"}, {"event": "ended", "job_id": "7", "outcome": outcome}]
        return events

    assert start_retries(chain()) == 0
    assert start_retries(chain("retried", "retried")) == 2
    assert start_retries(chain("retried", "requeued", "retried")) == 1  # a start that trained resets the count
    assert start_retries(chain("retried") + [{"event": "started", "job_id": "7"}]) == 1  # running now
    assert start_retries(chain("retried") + chain()) == 0  # a new submission


def test_doctor_hosts_count_only_from_this_job(tmp_path):
    record(RunDir(tmp_path), "started", job_id="7")
    doctor = tmp_path / "doctor.json"
    doctor.write_text(json.dumps({"bad_hosts": ["node1", 5, "", "node1", "node2"]}))
    assert doctor_bad_hosts(RunDir(tmp_path)) == ["node1", "node2"]
    chain = os.stat(tmp_path / "slurm" / "jobs.jsonl").st_mtime
    os.utime(doctor, (chain - 60, chain - 60))  # an earlier job's findings
    assert doctor_bad_hosts(RunDir(tmp_path)) == []
    for text in ("not json", "[1]", '{"bad_hosts": "node1"}', '{"bad_hosts": null}'):
        doctor.write_text(text)
        assert doctor_bad_hosts(RunDir(tmp_path)) == [], text
    doctor.unlink()
    assert doctor_bad_hosts(RunDir(tmp_path)) == []


# ---- job-end against a fake Slurm: scontrol and sinfo that log their arguments ------------------------------------
FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE_LOG"
case "$1" in
  show) echo "JobId=7 JobName=x Partition=debug NumNodes=$FAKE_NODES ExcNodeList=$FAKE_EXCLUDED Command=/r/job.sh" ;;
  update) [ -z "$FAKE_REFUSE" ] || { echo "Invalid node name specified" >&2; exit 1; } ;;
esac
"""


@pytest.fixture
def slurm(tmp_path, monkeypatch):
    """A fake scontrol, sinfo (node1 to node3) and sbatch on PATH; returns the log of their calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"scontrol": FAKE_SCONTROL, "sinfo": "#!/bin/bash\nprintf 'node1\\nnode2\\nnode3\\n'\n",
                       "sbatch": '#!/bin/bash\necho "sbatch $*" >> "$FAKE_LOG"\necho 8\n'}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_NODES", "1")
    monkeypatch.setenv("FAKE_EXCLUDED", "(null)")
    previous = signal.getsignal(signal.SIGTERM)  # job-end ignores the SIGTERM that `scontrol requeue` sends
    yield log
    signal.signal(signal.SIGTERM, previous)


def end_after_failed_start(run_dir, bad_hosts, on_stop="requeue"):
    record(RunDir(run_dir), "submitted", job_id="7")
    record(RunDir(run_dir), "started", job_id="7", restart=0, nodes="node1")
    (run_dir / "doctor.json").write_text(json.dumps({"bad_hosts": bad_hosts}))
    return job_end(RunDir(run_dir), 1, False, on_stop, 3, 2, env={"SLURM_JOB_ID": "7"})


def test_job_end_requeues_then_excludes_the_named_node(tmp_path, slurm, capsys):
    run_dir = tmp_path / "run"
    assert end_after_failed_start(run_dir, ["node1.cluster.local"]) == 0
    calls = slurm.read_text().splitlines()
    assert calls == ["scontrol show job -o 7", "scontrol requeue 7", "scontrol update JobId=7 ExcNodeList=node1"]
    ended = read_chain(RunDir(run_dir))[-1]
    assert (ended["outcome"], ended["excluded"]) == ("retried", "node1")
    assert excluded_nodes(read_chain(RunDir(run_dir))) == ["node1"]
    out = capsys.readouterr().out
    assert "retry 1 of at most 2 (slurm.max_start_retries)" in out
    assert "excluding node1 (named by clustertrain doctor) from the next start" in out


def test_job_end_keeps_the_nodes_excluded_before(tmp_path, slurm, monkeypatch):
    monkeypatch.setenv("FAKE_EXCLUDED", "node3")
    assert end_after_failed_start(tmp_path, ["node1"]) == 0
    assert slurm.read_text().splitlines()[-1] == "scontrol update JobId=7 ExcNodeList=node3,node1"


@pytest.mark.parametrize("nodes, hosts, refuse, line", [
    ("3", ["node1"], "", ("not excluding node1 (named by clustertrain doctor): partition debug would keep 2 node(s) "
                          "for a job of 3")),
    ("1", ["vm"], "", "not excluding vm (named by clustertrain doctor): not a node of partition debug"),
    ("1", ["node1"], "1", ("Slurm refused to exclude node1 (Invalid node name specified); requeued without "
                           "excluding them")),
])
def test_job_end_requeues_anyway_when_a_node_cannot_be_excluded(tmp_path, slurm, monkeypatch, capsys, nodes,
                                                                 hosts, refuse, line):
    monkeypatch.setenv("FAKE_NODES", nodes)
    monkeypatch.setenv("FAKE_REFUSE", refuse)
    assert end_after_failed_start(tmp_path, hosts) == 0
    assert "scontrol requeue 7" in slurm.read_text()
    assert line in capsys.readouterr().out
    ended = read_chain(RunDir(tmp_path))[-1]
    assert ended["outcome"] == "retried" and "excluded" not in ended


def test_a_follow_up_job_is_submitted_off_the_named_node(tmp_path, slurm):
    assert end_after_failed_start(tmp_path, ["node2"], on_stop="dependency") == 0
    assert slurm.read_text().splitlines()[-1] == "sbatch --parsable --dependency=afterany:7 --exclude=node2 /r/job.sh"
    ended = read_chain(RunDir(tmp_path))[-1]
    assert (ended["outcome"], ended["excluded"], ended["next_job"]) == ("retried", "node2", "8")
