"""`clustertrain export` of checkpoints that no rank held whole: 2-rank zero3 shards, tensor-parallel halves and
pipeline stages each become one Hugging Face model that computes what the run computed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import LayoutRuns, run_cli
from transformers import AutoModelForCausalLM

from clustertrain.config.load import load_config
from clustertrain.data.loader import StreamLoader
from clustertrain.data.pack import IGNORE_INDEX
from clustertrain.data.plan import DataPlan
from clustertrain.data.tokenize import cache_root, load_tokenizer
from clustertrain.train.metrics import read_metrics

pytestmark = pytest.mark.dist

STEPS = ["train.steps=4", "train.eval_every=4"]  # the held-out loss of the final weights, the checkpoint's
LAYOUTS = {
    "single": dict(nproc=None, overrides=[]),
    "zero3": dict(nproc=2, overrides=["parallel.strategy=zero3"]),
    "tp2": dict(nproc=2, overrides=["parallel.tp=2"]),
    "pp2": dict(nproc=2, overrides=["parallel.pp=2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return LayoutRuns(tmp_path_factory, LAYOUTS, *STEPS)


@pytest.fixture(scope="module")
def exports(runs, tmp_path_factory):
    """`exports[name]`: the HF directory `clustertrain export` writes from layout `name`'s run, made once."""
    class Exports(dict):
        def __missing__(self, name):
            out = tmp_path_factory.mktemp(f"export-{name}") / "hf"
            result = run_cli("export", str(runs[name]), str(out))
            assert result.returncode == 0, result.stderr[-3000:]
            self[name] = out
            return out

    return Exports()


def held_out_loss(model: torch.nn.Module, run_dir) -> float:
    """The model's mean token loss on the run's held-out batches, read with the run's own data settings."""
    config = load_config(run_dir / "config.yaml")
    seed = config.data_seed
    plan = DataPlan(config.data, load_tokenizer(config.data), config.train.global_batch_size, seed,
                    cache_root(config.data))
    loader = StreamLoader(plan, dp_rank=0, dp_size=1, split="eval")
    total, count = 0.0, 0
    with torch.no_grad():
        for _ in range(config.train.eval_batches):
            batch = loader.next_batch()
            logits = model(input_ids=batch["input_ids"]).logits
            total += F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX,
                                     reduction="sum").item()
            count += batch["labels"].ne(IGNORE_INDEX).sum().item()
    return total / count


@pytest.mark.parametrize("name", ["zero3", "tp2", "pp2"])
def test_a_sharded_checkpoint_exports_the_model_the_run_trained(runs, exports, name):
    exported = AutoModelForCausalLM.from_pretrained(exports[name]).eval()
    one_rank = AutoModelForCausalLM.from_pretrained(exports["single"]).eval()
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, expected = exported(ids).logits, one_rank(ids).logits
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), (got - expected).abs().max()
    # and independently of the 1-rank run: the exported model gives the held-out loss this run logged at its end
    logged = [r["eval_loss"] for r in read_metrics(runs[name] / "metrics.jsonl") if "eval_loss" in r]
    assert len(logged) == 1
    assert held_out_loss(exported, runs[name]) == pytest.approx(logged[0], rel=1e-5)
