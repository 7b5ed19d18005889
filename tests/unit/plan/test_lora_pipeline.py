"""LoRA pipeline stages in the plan: what a microbatch in flight keeps (its activations, never the frozen base's
weights or FSDP's gathered copy of them), and the shipped OPT-2.7B recipe fitting 8 GB nodes. In-process, on a
fake world; the real runs beside the plan are bench/lora_pipeline.py's table (docs/plan.md)."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY
from torch._subclasses.fake_tensor import FakeTensorMode

from clustertrain.plan.fake import LiveBytes
from clustertrain.resolve.load import load_checked_config
from clustertrain.resolve.run import resolve

ROOT_CONFIG = "configs/opt-pp-lora-cpu.yaml"
# facebook/opt-2.7b's config.json, built with random weights (no download)
OPT_2_7B = ["model.hub_id=null", "model.arch=opt",
            "model.config={hidden_size: 2560, ffn_dim: 10240, num_hidden_layers: 32, num_attention_heads: 32, "
            "word_embed_proj_dim: 2560, max_position_embeddings: 2048, vocab_size: 50272}"]


def test_a_view_of_a_tensor_made_before_the_step_allocates_nothing():
    with FakeTensorMode():
        weight = torch.empty(1000)  # a parameter: made before the step, and counted as one
        with LiveBytes() as counted:
            views = weight.t(), weight.view(10, 100), weight.detach(), weight[:10]
            assert counted.live == 0
            doubled = weight * 2
            assert counted.live == 4000 and counted.peak == 4000
            del views, doubled


def planned_stage0(strategy: str, microbatches: int, world: int):
    from clustertrain.plan.plan import measure_stage

    config = load_checked_config(None, [*TINY, "model.config.num_hidden_layers=4", "parallel.pp=2",
                                        "parallel.pp_schedule=gpipe", f"parallel.microbatches={microbatches}",
                                        f"parallel.strategy={strategy}", "parallel.activation_checkpoint=full",
                                        "parallel.param_dtype=float32", "lora.rank=4",
                                        f"train.global_batch_size={microbatches * world // 2}",
                                        "train.micro_batch_size=1"])
    run = resolve(config, world, world, "cpu")
    assert run.layout.grad_accum == microbatches and run.layout.micro_batch == 1
    return run.layout, measure_stage(run.config, run.layout, 0)


@pytest.mark.parametrize("strategy, world", [("ddp", 2), ("ddp", 4)])
def test_each_lora_microbatch_in_flight_keeps_its_block_inputs_not_a_copy_of_the_weights(strategy, world):
    """Under full checkpointing a microbatch in flight keeps each block's input (1 × 64 × 64 float32 here), the
    stage's input and output: under gpipe 4 microbatches keep twice what 2 do, and the difference is far below
    one copy of the stage's weights. FSDP's gathered weights (ddp under pp with data parallelism is FSDP2 over a
    replica group: they stay from forward to backward) are the stage's once, not each microbatch's."""
    two_layout, two = planned_stage0(strategy, 2, world)
    _, four = planned_stage0(strategy, 4, world)
    assert two_layout.wrapper == (None if world == 2 else "fsdp")
    block_input = 1 * 64 * 64 * 4
    per_microbatch = (four.activations - two.activations) / 2
    assert 2 * block_input <= per_microbatch <= 6 * block_input, (per_microbatch, block_input)
    assert four.peak - two.peak == pytest.approx(2 * per_microbatch, abs=8 * block_input)
    block_weights = 4 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)  # q, o; k, v; the MLP (float32)
    assert per_microbatch < block_weights / 2


def test_the_shipped_opt_recipe_fits_8_gb_nodes_by_the_plan():
    """configs/opt-pp-lora-cpu.yaml on its own nodes and ranks per node (slurm.nodes, slurm.tasks_per_node),
    OPT-2.7B's shape, each rank given its share of an 8 GB node."""
    from clustertrain.plan.plan import make_plan
    from clustertrain.plan.target import TargetRequest, target_for

    config = load_checked_config(ROOT_CONFIG, OPT_2_7B)
    per_node = config.slurm.tasks_per_node
    target = target_for(config, TargetRequest(nodes=config.slurm.nodes, ranks_per_node=per_node,
                                              device_memory_gb=8 / per_node))
    run = resolve(target.config, target.world, per_node, "cpu")
    plan = make_plan(run.config, run.layout, per_node, target.device)
    assert plan.fits, [stage.peak / 1e9 for stage in plan.stages]
    params = 2.65e9 * 2 / run.layout.degree("pp") / run.layout.degree("dp_shard")  # the float16 base, its share
    assert all(stage.params > 0.9 * params for stage in plan.stages)  # the whole model is planned, not a stub
