"""Files written so that no reader, and no crash, ever sees half of one: the package's one atomic write."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

HOST = socket.gethostname()


def write_atomic(path: Path, data: str | bytes, durable: bool = False) -> None:
    """Write `data` to `path` through a temporary sibling renamed over it: a reader sees the old file or the new
    one, never part of either. `durable`: flushed to disk before the rename (a checkpoint's files, which must
    survive a node crash). The temporary name is this thread's own, on this host (a rank's watchdog thread and
    main thread both write its heartbeat; ranks on several nodes may share a pid), so writers of one file never
    mix; it is removed if the write fails."""
    tmp = path.with_name(f".{path.name}.tmp-{HOST}-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
