"""The run's one-line state in <run_dir>/status.json: running, preempted, finished or failed.

Launchers read it to decide what comes next (`clustertrain slurm job-end` requeues only a run that was
stopped on purpose), because an exit code does not survive every launcher (torchrun reports 1).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

STATUS_FILE = "status.json"


def write_status(run_dir: Path, state: str, **fields: Any) -> None:
    """Replace the run's status atomically, stamped with the time, host and Slurm job (if any)."""
    record = {
        "state": state,
        "time": time.time(),
        "host": socket.gethostname(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        **fields,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{STATUS_FILE}.tmp"
    tmp.write_text(json.dumps(record, default=str) + "\n")
    os.replace(tmp, run_dir / STATUS_FILE)


def read_status(run_dir: Path) -> dict[str, Any] | None:
    """The last status written, or None if there is none (or it is unreadable)."""
    try:
        return json.loads((run_dir / STATUS_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
