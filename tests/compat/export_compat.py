"""Files written with the project's transformers (5.x) load and compute the same under transformers 4.57.

    python tests/compat/export_compat.py write DIR   # project venv: train, export a model and an adapter, record logits
    python tests/compat/export_compat.py check DIR   # transformers 4.57: load both, compare token ids and logits;
                                                     # export the 5.x run's checkpoint, compare; train on the
                                                     # tokenizer cache the 5.x run left in DIR/cache

`make test-oldest` runs both (the second in the oldest venv: torch 2.8, transformers 4.57). The model has
rope_theta 500,000, so an export whose config transformers 4.x reads with its default of 10,000 fails the check.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

TEXT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"


def logits_of(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, :, :16].flatten().tolist()


def use_tests_and_cache(out: Path) -> None:
    """Import from tests/, as pytest does for the suite; keep the tokenizer cache in `out`, shared by both steps."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ["CLUSTERTRAIN_CACHE"] = str(out / "cache")


def write(out: Path) -> None:
    use_tests_and_cache(out)
    import peft
    from helpers import TINY, run_cli, train
    from transformers import AutoModelForCausalLM, AutoTokenizer

    theta = ("model.config={hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
             "num_key_value_heads: 2, max_position_embeddings: 256, rope_theta: 500000}")
    train(out / "run", *TINY, theta, "train.steps=2")
    assert run_cli("export", str(out / "run"), str(out / "model")).returncode == 0
    train(out / "lora-run", *TINY, f"model.path={out / 'model'}", "model.config={}", "lora.rank=4", "optim.lr=1e-2",
          "train.steps=2")
    assert run_cli("export", str(out / "lora-run"), str(out / "adapter")).returncode == 0
    ids = AutoTokenizer.from_pretrained(out / "model")(TEXT)["input_ids"]
    base = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    expected = {"ids": ids, "model": logits_of(base, ids)}
    expected["adapter"] = logits_of(peft.PeftModel.from_pretrained(base, out / "adapter").eval(), ids)
    (out / "expected.json").write_text(json.dumps(expected))


def check(out: Path) -> None:
    use_tests_and_cache(out)
    import peft
    import transformers
    from helpers import run_cli, train
    from transformers import AutoModelForCausalLM, AutoTokenizer

    expected = json.loads((out / "expected.json").read_text())
    ids = AutoTokenizer.from_pretrained(out / "model")(TEXT)["input_ids"]
    assert ids == expected["ids"], f"token ids differ: {ids} != {expected['ids']}"
    base = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    got = {"model": logits_of(base, ids)}  # before peft puts the adapter into `base`
    got["adapter"] = logits_of(peft.PeftModel.from_pretrained(base, out / "adapter").eval(), ids)
    # The 5.x run's checkpoint (its tokenizer saved by 5.x) exported here: the same model as out/model.
    assert run_cli("export", str(out / "run"), str(out / "model-4")).returncode == 0
    assert AutoTokenizer.from_pretrained(out / "model-4")(TEXT)["input_ids"] == ids
    got["checkpoint"] = logits_of(AutoModelForCausalLM.from_pretrained(out / "model-4").eval(), ids)
    want = {**expected, "checkpoint": expected["model"]}
    for name in got:
        diff = (torch.tensor(got[name]) - torch.tensor(want[name])).abs().max().item()
        assert diff < 1e-4, f"{name}: logits differ by {diff} under transformers {transformers.__version__}"
    print(f"exports and a checkpoint load under transformers {transformers.__version__} and peft {peft.__version__}: "
          "same logits")

    cached = sorted((out / "cache" / "tokenizers").iterdir())
    train(out / "run-4", "train.steps=1")
    assert sorted((out / "cache" / "tokenizers").iterdir()) == cached, "the 4.57 run trained a tokenizer of its own"
    print(f"a run under transformers {transformers.__version__} trains on the tokenizer a 5.x run cached")


if __name__ == "__main__":
    {"write": write, "check": check}[sys.argv[1]](Path(sys.argv[2]))
