"""Files written where the user said (`config convert -o`, `slurm render -o`): never over one of the command's
inputs, never over an existing file without `--force`, and a replaced file swapped whole, never half-written."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from clustertrain.errors import UserError


def write_output(path: str | Path, text: str, inputs: Iterable[str | Path] = (), force: bool = False,
                 flag: str = "-o") -> None:
    """Write `text` to `path`.

    Raises:
        UserError: `path` is one of `inputs` (even with `force`: the command would destroy what it read), a
            directory, an existing file without `force`, or cannot be written; nothing is changed then.
    """
    out = Path(path)
    for given in inputs:
        if _same_file(out, Path(given)):
            raise UserError(f"{flag} {path}: that is the input {given}; write the output to another file")
    if out.is_dir():
        raise UserError(f"{flag} {path} is a directory; give the file to write")
    try:
        if not force:
            with open(out, "x", encoding="utf-8") as f:  # exclusive: a file that appears meanwhile is kept too
                f.write(text)
            return
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    except FileExistsError:
        raise UserError(f"{flag} {path} exists; give another file, or --force to replace it") from None
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write it ({e.strerror or e})") from None


def _same_file(a: Path, b: Path) -> bool:
    """The same file: one path, a symlink to it or a hard link (same device and inode)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return a.resolve() == b.resolve()
