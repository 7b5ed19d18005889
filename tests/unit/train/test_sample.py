"""The end-of-run sample's prompt comes from the run's own data: held-out first, an SFT example's prompt."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import TINY, run_cli

from clustertrain.config.data_schema import DataConfig
from clustertrain.data.plan import DataPlan
from clustertrain.data.tokenize import load_tokenizer
from clustertrain.train.sample import PROMPT_TOKENS, data_prompt

GUANACO = [{"text": f"<s>[INST] What is {a} plus {b}? [/INST] {a + b}, since {a} and {b} make {a + b}. </s>"}
           for a in range(10) for b in range(10)]


def prompt_of(tmp_path, source: dict, **data) -> str:
    config = DataConfig.model_validate({"sources": [source], "vocab_size": 300, "cache_dir": str(tmp_path / "cache"),
                                        "seq_len": 64, **data})
    tokenizer = load_tokenizer(config)
    plan = DataPlan(config, tokenizer, 4, seed=1, cache_dir=tmp_path / "cache")
    ids = data_prompt(plan, tokenizer)
    assert ids[0] == tokenizer.eos_token_id or data.get("mode") == "sft"  # a document starts after end-of-text
    return tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("layout", ["parquet", "save_to_disk", "jsonl"])
def test_an_sft_run_samples_its_first_held_out_prompt(tmp_path, layout):
    """Guanaco as users have it: the hub's parquet file, a `save_to_disk` folder, or jsonl, pointed at by path."""
    if layout == "parquet":
        (tmp_path / "guanaco" / "data").mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(GUANACO), tmp_path / "guanaco" / "data" / "train-00000-of-00001.parquet")
        path = tmp_path / "guanaco" / "data" / "*.parquet"
    elif layout == "save_to_disk":
        import datasets

        datasets.Dataset.from_list(GUANACO).save_to_disk(str(tmp_path / "on-disk"))
        path = tmp_path / "on-disk"
    else:
        path = tmp_path / "guanaco.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in GUANACO))
    prompt = prompt_of(tmp_path, {"path": str(path), "field": "text"}, mode="sft", eval_fraction=0.1)
    assert "What is 0 plus 2?" in prompt and prompt.rstrip().endswith("[/INST]"), prompt  # no answer: the model's


@pytest.mark.parametrize("eval_fraction, line", [(0.1, 2), (0.0, 0)])  # 2 and 18 of the 20 are held out
def test_a_text_run_samples_the_start_of_its_first_held_out_document(tmp_path, eval_fraction, line):
    lines = [f"document {i} begins with its own words, then goes on for a while about topic {i}." for i in range(20)]
    (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n")
    prompt = prompt_of(tmp_path, {"path": str(tmp_path / "corpus.txt"), "text_unit": "line"},
                       eval_fraction=eval_fraction)
    assert len(prompt) > PROMPT_TOKENS and lines[line].startswith(prompt), prompt


def test_random_data_samples_from_the_end_of_text_token(tmp_path):
    config = DataConfig.model_validate({"mode": "random", "vocab_size": 300, "cache_dir": str(tmp_path)})
    tokenizer = load_tokenizer(DataConfig.model_validate({"sources": [{"format": "stdlib", "max_bytes": 20000}],
                                                          "vocab_size": 300, "cache_dir": str(tmp_path)}))
    plan = DataPlan(config, tokenizer, 4, seed=1, cache_dir=tmp_path)
    assert data_prompt(plan, tokenizer) == [tokenizer.eos_token_id]


@pytest.mark.dist
def test_an_sft_run_from_a_downloaded_dataset_ends_with_its_model_answering_a_held_out_prompt(tmp_path):
    """The recipes' data route: `clustertrain download ID --dataset` (here --from-dir: no network), read offline
    by `hf_name`; the run's last line is the model's continuation of the first held-out question."""
    (tmp_path / "repo" / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(GUANACO), tmp_path / "repo" / "data" / "train-00000-of-00001.parquet")
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    staged = run_cli("download", "org/guanaco", "--dataset", "--from-dir", str(tmp_path / "repo"), env=env)
    assert staged.returncode == 0, staged.stderr
    result = run_cli("train", *(f"--set={o}" for o in (
        *TINY, "data.mode=sft", "data.sources=[{hf_name: org/guanaco, field: text}]", "data.vocab_size=300",
        "data.eval_fraction=0.1", "train.steps=2", f"train.run_dir={tmp_path / 'run'}")), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "\n       sample  [INST] What is 0 plus 2? [/INST]" in result.stdout, result.stdout[-2000:]
