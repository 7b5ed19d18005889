"""A fine-tune on the GPU that learns (SFT packs whole examples into rows: `auto` attention keeps them apart with
flash-attn or flex attention), then `eval` and `generate` with `--device cuda`."""

from __future__ import annotations

import json

import pytest
from helpers import run_cli, train

from clustertrain.cli import main
from clustertrain.data.synthetic import read_task

# tests/e2e/test_generate_eval.py's reverse task: from ~0% to most answers right in 120 steps
REVERSE_TASK = [
    "model.config={hidden_size: 128, intermediate_size: 256, num_hidden_layers: 2, num_attention_heads: 8, "
    "num_key_value_heads: 8, max_position_embeddings: 256}",
    "data.mode=sft", "data.seq_len=128", "train.micro_batch_size=8", "train.steps=120", "optim.lr=5e-3",
    "optim.warmup_steps=20", "checkpoint.every=0", "metrics.log_every=20",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(run directory, task directory, the run's output) of one SFT run on the GPU."""
    root = tmp_path_factory.mktemp("reverse")
    assert main(["eval", "--make-task", str(root / "task"), "--train", "5000", "--test", "200"]) == 0
    result = train(root / "run", *REVERSE_TASK, f"data.sources=[{{path: {root / 'task' / 'train.jsonl'}}}]")
    return root / "run", root / "task", result


def evaluate(source, task, *extra: str) -> dict:
    result = run_cli("eval", str(source), "--data", str(task / "test.jsonl"), "--limit", "100", "--json", *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_sft_on_the_gpu_learns_and_eval_runs_on_cuda(trained):
    run, task, result = trained
    assert " on cuda, " in result.stdout
    assert "flash_attention_2 attention" in result.stdout or "flex_attention attention" in result.stdout
    on_gpu = evaluate(run, task, "--device", "cuda")  # auto: bf16
    assert on_gpu["accuracy"] > 0.5, on_gpu["accuracy"]
    gpu_fp32, cpu_fp32 = evaluate(run, task, "--device", "cuda", "--dtype", "fp32"), evaluate(run, task, "--device",
                                                                                             "cpu", "--dtype", "fp32")
    same = sum(a["answer"] == b["answer"] for a, b in zip(gpu_fp32["examples"], cpu_fp32["examples"]))
    assert same >= 95, f"{same} of 100 greedy answers agree between the GPU and the CPU in fp32"


def test_generate_on_cuda_agrees_with_eval_on_cuda(trained):
    run, task, _ = trained
    record = read_task(task / "test.jsonl")[0]
    generated = run_cli("generate", str(run), "--prompt", record["prompt"], "--temperature", "0", "--max-tokens", "6",
                        "--device", "cuda", "--dtype", "fp32")
    assert generated.returncode == 0, generated.stderr[-3000:]
    [scored] = evaluate(run, task, "--limit", "1", "--max-tokens", "6", "--device", "cuda", "--dtype", "fp32")[
        "examples"]
    assert generated.stdout == scored["answer"] + "\n"
