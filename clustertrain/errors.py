"""User errors: the only exceptions the CLI shows without a traceback (exit code 2)."""


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
