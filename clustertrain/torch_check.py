"""The torch this environment has, against the oldest one clustertrain supports.

clustertrain never installs torch over the one a cluster provides (it is not a pip dependency: a ROCm or
CUDA build would be replaced by PyPI's). So the check runs before `make install` touches anything
(`python -m clustertrain.torch_check`, standard library only) and at the start of every command that trains
or loads a model. The oldest supported release is the oldest the CI runs its smoke subset on.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

MIN_TORCH = (2, 8)


def torch_problem(version: str | None, missing_ok: bool = False) -> str | None:
    """One line saying which torch to install when `version` (None: no torch) is too old or missing, else None."""
    wanted = ".".join(map(str, MIN_TORCH))
    if version is None:
        return None if missing_ok else (f"clustertrain needs torch >= {wanted} and none is installed: pip install "
                                        f"'torch>={wanted}' (your cluster's ROCm or CUDA build; README: 'Which torch')")
    if tuple(int(n) for n in re.findall(r"\d+", version)[:2]) >= MIN_TORCH:
        return None
    build = next((b for tag, b in (("rocm", "rocm6.4"), ("+cu", "cu128"), ("+cpu", "cpu")) if tag in version), None)
    index = f" --index-url https://download.pytorch.org/whl/{build}" if build else ""
    return (f"clustertrain needs torch >= {wanted} and this environment has torch {version}: install a newer "
            f"build over it, e.g. pip install 'torch>={wanted}'{index} (README: 'Which torch')")


def installed_torch() -> str | None:
    """The installed torch's version string (e.g. '2.5.1+rocm6.1'), read without importing torch."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    problem = torch_problem(installed_torch(), missing_ok=True)  # make install then installs a CPU build
    if problem:
        print(f"error: {problem}", file=sys.stderr)
    sys.exit(2 if problem else 0)  # errors.ExitCode.USER_ERROR or OK, as literals: this file imports no clustertrain
