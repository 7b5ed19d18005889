"""Every shipped config renders its Slurm script and fits each node count its `# nodes:` comment names.

The models the recipes fine-tune are stood in for by their config.json (the fields a layout depends on), as
`clustertrain config check` reads them on a login node: no weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clustertrain.config.layout import check_world
from clustertrain.launch.slurm import job_spec, render_script
from clustertrain.model.spec import model_shape
from clustertrain.resolve.load import load_checked_config

ROOT = Path(__file__).parents[3]
CONFIGS = sorted((ROOT / "configs").glob("*.*"))
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}
SNAPSHOTS = {  # model.hub_id, or model.path's folder name -> its config.json (the layout's fields)
    "distilgpt2": {"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 6, "vocab_size": 50257},
    "facebook/opt-2.7b": {"model_type": "opt", "hidden_size": 2560, "ffn_dim": 10240, "num_hidden_layers": 32,
                          "num_attention_heads": 32, "vocab_size": 50272},
    "Meta-Llama-3-8B": LLAMA3_8B,
    "meta-llama/Meta-Llama-3-8B-Instruct": LLAMA3_8B,
}


def node_counts(path: Path) -> list[int]:
    lines = [line for line in path.read_text().splitlines() if line.startswith("# nodes:")]
    assert len(lines) == 1, f"{path.name}: name the node counts it is meant for in one `# nodes: 1, 2` line"
    return [int(n) for n in lines[0].removeprefix("# nodes:").split(",")]


def stand_in(path: Path, tmp_path: Path) -> list[str]:
    """Overrides that point a fine-tuning recipe at its model's config.json."""
    model = load_checked_config(path).model
    if not model.pretrained:
        return []
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "config.json").write_text(json.dumps(SNAPSHOTS[model.hub_id or Path(model.path).name]))
    return ["model.hub_id=null", f"model.path={snapshot}"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_renders_and_fits_its_node_counts(path, tmp_path):
    overrides = stand_in(path, tmp_path)
    for nodes in node_counts(path):
        config = load_checked_config(path, [*overrides, f"slurm.nodes={nodes}"])
        script = render_script(config, [f"configs/{path.name}"], ROOT, f"configs/{path.name}")
        assert f"#SBATCH --nodes={nodes}\n" in script
        spec = job_spec(config.slurm)
        shape = model_shape(config.model, config.data.vocab_size)
        assert check_world(config, spec.world_size, spec.tasks_per_node, shape) == [], f"{path.name} on {nodes} nodes"


def test_the_global_batch_the_cpu_recipes_had_does_not_fit_the_node_counts_users_run(tmp_path):
    """Why the CPU recipes give the batch per rank: a global batch of 16 fits neither 5, 10 nor 20 nodes."""
    path = ROOT / "configs" / "distilgpt2-lora-cpu.yaml"
    overrides = [*stand_in(path, tmp_path), "train.global_batch_size=16"]
    for nodes in (5, 10, 20):
        config = load_checked_config(path, [*overrides, f"slurm.nodes={nodes}"])
        problems = check_world(config, nodes, 1, model_shape(config.model, config.data.vocab_size))
        assert [p.split(";")[0] for p in problems] == [
            f"train.global_batch_size = 16 is not divisible by the {nodes} data-parallel ranks"]


def test_the_frontier_lora_sft_recipe_is_a_whole_job(tmp_path):
    path = ROOT / "configs" / "frontier-lora-sft-llama3.yaml"
    config = load_checked_config(path, stand_in(path, tmp_path))
    assert (config.data.mode, config.lora.enabled, config.parallel.strategy, config.parallel.param_dtype) == (
        "sft", True, "zero3", "bfloat16")
    assert config.train.epochs and config.train.grad_accum and config.data.sources[0].hf_name
    script = render_script(config, [f"configs/{path.name}"], ROOT, f"configs/{path.name}")
    assert "#SBATCH --account=abc123" in script and "--ntasks-per-node=8" in script
    assert "export HF_HUB_OFFLINE=1" in script  # the snapshot and the dataset are read from $HF_HOME, offline
