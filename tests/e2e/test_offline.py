"""No hub call unless asked: every command but `download` runs with HF_HUB_OFFLINE=1, so an adapter whose base is
a hub id missing from the local cache fails at once in one line naming the download command (it used to retry
the hub five times, 27 s), while a base in the cache loads with no network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from helpers import write_tiny_repo

from clustertrain.model.download import download, local_fetch

pytestmark = pytest.mark.dist  # starts the CLI as users do


@contextmanager
def fake_hub():
    """An HTTP server standing in for the hub (HF_ENDPOINT): it answers every request 503 and lists the paths asked."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def _refuse(self):
            asked.append(self.path)
            self.send_response(503)
            self.end_headers()

        do_GET = do_HEAD = _refuse

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


def clustertrain(*args: str, hf_home: Path, endpoint: str | None = None) -> subprocess.CompletedProcess:
    """`python -m clustertrain ARGS` with the caller's offline switches removed, as on a login node."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE")}
    env["HF_HOME"] = str(hf_home)
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    return subprocess.run([sys.executable, "-m", "clustertrain", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def write_adapter(folder: Path, base: str) -> Path:
    """A LoRA adapter folder as peft writes it, on the base model `base`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                         vocab_size=128)
    model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=2, target_modules=["q_proj"]))
    model.peft_config["default"].base_model_name_or_path = base
    model.save_pretrained(folder)
    return folder


def test_an_adapter_on_an_uncached_hub_base_fails_at_once_in_one_line(tmp_path):
    adapter = write_adapter(tmp_path / "adapter", "org/not-cached")
    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    for command in (["generate", str(adapter), "--prompt", "the"], ["eval", str(adapter), "--data", str(data)]):
        with fake_hub() as (endpoint, asked):
            result = clustertrain(*command, hf_home=tmp_path / "hf", endpoint=endpoint)
        assert asked == [], f"{command[0]} called the hub: {asked}"
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
        assert "base model 'org/not-cached'" in result.stderr
        assert "clustertrain download org/not-cached" in result.stderr


def test_an_adapter_on_a_cached_hub_base_loads_offline(tmp_path):
    download("org/tiny-base", cache_dir=tmp_path / "hf" / "hub", fetch=local_fetch(write_tiny_repo(tmp_path / "base")))
    adapter = write_adapter(tmp_path / "adapter", "org/tiny-base")
    result = clustertrain("generate", str(adapter), "--prompt", "the quick", "--max-tokens", "4",
                             hf_home=tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and "couldn't connect" not in result.stderr, result.stderr
