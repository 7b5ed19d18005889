"""User errors: the only exceptions the CLI shows without a traceback (exit code 2)."""

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path

# Set by the Slurm job script: where a rank notes its user error for `slurm job-end`, which must not retry it.
USER_ERROR_NOTE = "CLUSTERTRAIN_USER_ERROR_FILE"


class UserError(Exception):
    """A problem with the user's input: config, files, data, flags. The message is one line per problem."""

    exit_code = 2


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


def note_user_error(error: BaseException, env: Mapping[str, str] = os.environ) -> None:
    """Inside a Slurm job, leave `error` where the job's end finds it: srun's exit code turns a rank's 2 into
    the 143 of the peers it kills, which would read as a start that failed and be retried. Best effort."""
    if path := env.get(USER_ERROR_NOTE):
        with contextlib.suppress(OSError):
            Path(path).write_text(first_line(error) + "\n")
