"""Logging for every command, set up in one place: `--log-level`, rank 0 talks, library warnings filtered.

The package logs through `logging.getLogger(__name__)`; lines read `warning: ...` as they always have. Python
warnings go through logging too (`py.warnings`), and the libraries' own chatter is cut to what a user acts on.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

LOG_LEVELS = ("debug", "info", "warning", "error")
LEVEL_ENV = "CLUSTERTRAIN_LOG_LEVEL"  # how ranks a command starts (--nproc, Slurm steps) inherit --log-level

# Warnings that say nothing a clustertrain user can act on: the libraries' deprecations of their own internals, and
# torch's notes on its own machinery. (category, message regex, module regex: where the warning is attributed, or
# "" for any); shown again from --log-level debug on.
LIBRARIES = r"(transformers|peft|datasets|huggingface_hub|accelerate|torch|tokenizers)(\..*)?"
QUIET_WARNINGS = [
    (FutureWarning, r".*", LIBRARIES),
    (DeprecationWarning, r".*", LIBRARIES),
    (UserWarning, r".*TypedStorage is deprecated.*", ""),
    (UserWarning, r".*(_register_pytree_node|torch\.utils\._pytree).*", ""),
    (UserWarning, r".*No device id is provided via `init_process_group` or `barrier`.*", ""),
    (UserWarning, r".*This DataLoader will create .* worker processes in total.*", ""),
]


class _Lowercase(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.name == "py.warnings":  # `path:line: Category: text`, as the warnings module writes it
            return f"warning: {message.strip()}"
        return f"{record.levelname.lower()}: {message}" if record.levelno >= logging.WARNING else message


class _Stderr(logging.StreamHandler):
    """A handler on whatever sys.stderr is at the time of each record (a test's capture, a redirected stream)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


class _Rank0(logging.Filter):
    """Only rank 0 talks, unless every rank was asked to (`--log-all-ranks`); errors always pass."""

    def __init__(self, rank: int, all_ranks: bool):
        super().__init__()
        self.rank, self.all_ranks = rank, all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        if self.all_ranks and self.rank:
            record.msg = f"[rank {self.rank}] {record.msg}"
        return self.rank == 0 or self.all_ranks or record.levelno >= logging.ERROR


def setup_logging(level: str | None, all_ranks: bool = False) -> None:
    """Configure the `clustertrain` logger and library verbosity for this process and the ranks it starts.

    Args:
        level: one of LOG_LEVELS, or None for the inherited CLUSTERTRAIN_LOG_LEVEL, else info.
        all_ranks: every rank logs, its lines prefixed with its rank (`--log-all-ranks`).
    """
    level = level or os.environ.get(LEVEL_ENV, "info").lower()
    if level not in LOG_LEVELS:
        level = "info"
    os.environ[LEVEL_ENV] = level
    numeric = getattr(logging, level.upper())
    handler = _Stderr()
    handler.setFormatter(_Lowercase())
    handler.addFilter(_Rank0(_rank(), all_ranks))
    for name in ("clustertrain", "py.warnings"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(numeric)
        logger.propagate = False
    logging.captureWarnings(True)
    quiet_libraries(level)


def quiet_libraries(level: str) -> None:
    """Cut transformers', datasets' and torch's warnings to errors and the ones that matter, unless debugging."""
    library_level = "info" if level == "debug" else "error"
    for variable in ("TRANSFORMERS_VERBOSITY", "DATASETS_VERBOSITY"):  # read when they are imported, and by ranks
        os.environ.setdefault(variable, library_level)
    if level == "debug":
        return
    for category, message, module in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def _rank() -> int:
    from clustertrain.distributed.env import detect_launcher
    from clustertrain.errors import UserError

    try:
        return detect_launcher().rank
    except UserError:
        return 0
