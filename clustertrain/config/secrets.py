"""Secrets have no place in a config: it is copied into every run directory, checkpoint and job script.

Found by name (an environment variable such as HF_TOKEN or SLACK_WEBHOOK_URL) and by value (the shapes of
the tokens people paste: Hugging Face, GitHub, AWS, Slack, OpenAI-style keys, private keys, credentials in a
URL), in every string of the config.
"""

from __future__ import annotations

import re
from typing import Any

SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|API_?KEY|ACCESS_KEY|PRIVATE_KEY|WEBHOOK", re.IGNORECASE)

SECRET_VALUES = {
    "Hugging Face token": re.compile(r"\bhf_[A-Za-z0-9]{30,}"),
    "GitHub token": re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})"),
    "AWS access key": re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    "Slack token or webhook": re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}|hooks\.slack\.com/services/\S+"),
    "API key": re.compile(r"\bsk-(?:ant-|proj-)?[A-Za-z0-9_-]{20,}"),
    "private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "password in a URL": re.compile(r"\b[a-z][a-z0-9+.-]*://[^/\s:@]+:[^/\s@]+@"),
}


def secret_kind(value: str) -> str | None:
    """What kind of secret `value` holds, or None."""
    return next((kind for kind, pattern in SECRET_VALUES.items() if pattern.search(value)), None)


def find_secrets(tree: Any, key: str = "") -> list[str]:
    """One problem line per config value (at dotted `key`) that holds a secret."""
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in find_secrets(v, f"{key}.{k}" if key else str(k))]
    if isinstance(tree, (list, tuple)):
        return [p for i, v in enumerate(tree) for p in find_secrets(v, f"{key}[{i}]")]
    kind = secret_kind(tree) if isinstance(tree, str) else None
    if kind is None:
        return []
    return [f"config error: {key} holds what looks like a {kind}; a config is copied into run directories, "
            "checkpoints and job scripts, so keep it out: export it in the shell you start from (sbatch passes "
            "your environment to the job)"]
