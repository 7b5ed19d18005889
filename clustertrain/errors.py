"""User errors: the only exceptions the CLI shows without a traceback (exit code 2); the one table of exit codes;
what a one-line report quotes of another error."""

import contextlib
import enum
import os
from collections.abc import Mapping
from pathlib import Path

# Set by the Slurm job script: where a rank notes its user error for `slurm job-end`, which must not retry it.
USER_ERROR_NOTE = "CLUSTERTRAIN_USER_ERROR_FILE"


class ExitCode(enum.IntEnum):
    """Every exit code clustertrain ends with on purpose, and what it tells a launcher or a job script
    (launch/jobs.decide reads them; the job script's shell keeps them as literals). Anything else is a signal's
    (128 + N) or a launcher's own."""

    OK = 0
    FAILED = 1  # a bug (with its traceback), or a check that did not pass: verify, plan, status, doctor
    USER_ERROR = 2  # a bad config, file, flag or data: one line; the user's to fix, never retried
    DIVERGED = 3  # the loss or the gradient norm became NaN or inf (train.on_nan)
    SAVE_FAILED = 74  # EX_IOERR: a checkpoint, an export or a staged shard could not be written (disk full, quota)
    REQUEUE = 75  # EX_TEMPFAIL, "try again later": the run saved and stopped on purpose; requeue it
    HUNG = 76  # the watchdog ended a hung run: requeue it, it resumes from its last checkpoint
    INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as a shell reports it


class UserError(Exception):
    """A problem with the user's input: config, files, data, flags. The message is one line per problem."""

    exit_code = ExitCode.USER_ERROR


class ConfigError(UserError):
    """A config key or value is wrong."""


class DataError(UserError):
    """A data file is missing or malformed."""


class LaunchError(UserError):
    """The launcher environment is inconsistent or incomplete."""


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete or does not fit the run."""


def first_line(error: BaseException | str) -> str:
    """The first line of an error's message (its type's name when it has none): what a one-line report quotes."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def one_line(error: BaseException | str) -> str:
    """An error's whole message on one line, its runs of whitespace (newlines too) made single spaces: what a
    message quotes of a library's error (a YAML mark, a traceback-like text) without breaking its own line."""
    return " ".join(str(error).split())


def note_user_error(error: BaseException, env: Mapping[str, str] = os.environ) -> None:
    """Inside a Slurm job, leave `error` where the job's end finds it: srun's exit code turns a rank's 2 into
    the 143 of the peers it kills, which would read as a start that failed and be retried. Best effort."""
    if path := env.get(USER_ERROR_NOTE):
        with contextlib.suppress(OSError):
            Path(path).write_text(first_line(error) + "\n")
