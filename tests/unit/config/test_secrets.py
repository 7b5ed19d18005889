"""Secrets never reach a run directory or a job script: refused by the shape of their value, wherever they are,
and by the name of the environment variable that would carry them."""

from __future__ import annotations

import pytest

from clustertrain.config.load import load_config
from clustertrain.errors import ConfigError

HF = "hf_" + "aB3dE5gH7jK9mN1pQ3sT5vW7yZ9bC1dE3"
CASES = {  # override -> (key named, kind named)
    f"slurm.env={{MY_VAR: {HF}}}": ("slurm.env.MY_VAR", "Hugging Face token"),
    f"slurm.setup=['huggingface-cli login --token {HF}']": ("slurm.setup[0]", "Hugging Face token"),
    f"slurm.sbatch={{comment: 'token {HF}'}}": ("slurm.sbatch.comment", "Hugging Face token"),
    "slurm.modules=[ghp_" + "a1" * 18 + "]": ("slurm.modules[0]", "GitHub token"),
    "slurm.env={X: github_pat_" + "A1_" * 12 + "}": ("slurm.env.X", "GitHub token"),
    "slurm.env={X: AKIA" + "ABCD1234EFGH5678" + "}": ("slurm.env.X", "AWS access key"),
    "slurm.env={NOTIFY: 'https://hooks.slack.com/services/T000/B000/XXXX'}": ("slurm.env.NOTIFY", "Slack"),
    "slurm.env={X: xoxb-" + "1234567890-abcdef" + "}": ("slurm.env.X", "Slack"),
    "slurm.env={X: sk-proj-" + "Ab1" * 8 + "}": ("slurm.env.X", "API key"),
    "slurm.setup=['echo -----BEGIN OPENSSH PRIVATE KEY-----']": ("slurm.setup[0]", "private key"),
    "data.sources=[{path: 'https://me:pa55word@example.org/corpus.jsonl'}]": ("data.sources[0].path",
                                                                             "password in a URL"),
    "train.run_dir=runs/" + HF: ("train.run_dir", "Hugging Face token"),
}


@pytest.mark.parametrize("override", CASES)
def test_a_secret_by_value_is_refused_naming_its_key(override):
    key, kind = CASES[override]
    with pytest.raises(ConfigError) as refused:
        load_config(None, [override])
    message = str(refused.value)
    assert message.startswith(f"config error: {key} holds what looks like a {kind}"), message
    assert "\n" not in message and HF not in message  # one line, and the secret is not echoed


@pytest.mark.parametrize("name", ["HF_TOKEN", "SLACK_WEBHOOK_URL", "WANDB_API_KEY", "MY_APIKEY", "DB_PASSWORD",
                                  "AWS_SECRET_ACCESS_KEY"])
def test_a_secret_by_name_is_refused(name):
    with pytest.raises(ConfigError, match=f"env.{name} looks like a secret"):
        load_config(None, [f"slurm.env={{{name}: x}}"])


@pytest.mark.parametrize("override", [
    "slurm.env={HF_HOME: /scratch/hf, NCCL_SOCKET_IFNAME: hsn0, GOOGLE_APPLICATION_CREDENTIALS: /home/me/k.json}",
    "slurm.setup=['source /ccs/proj/abc123/envs/hf_env/bin/activate']",  # hf_ in a path, not a token
    "slurm.sbatch={comment: 'git 0123456789abcdef0123456789abcdef01234567'}",
    "data.sources=[{path: 'https://example.org/corpus.jsonl'}]",
])
def test_ordinary_values_pass(override):
    load_config(None, [override])
