"""What a planner calls on a login node: a run's model and its layout for 8 ranks at tp 2, with no process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from clustertrain.config.layout import check_world, resolve_layout
from clustertrain.errors import ConfigError
from clustertrain.model.build import build_model
from clustertrain.model.spec import model_shape
from clustertrain.resolve.load import load_checked_config

COMMON = ["data.vocab_size=512", "data.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=2",
          "parallel.tp=2"]
LLAMA = ["model.config={hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
         "num_key_value_heads: 2, max_position_embeddings: 256}", *COMMON]
GPT2 = ["model.arch=gpt2", "model.config={n_embd: 64, n_layer: 2, n_head: 4, n_positions: 256}", *COMMON]


def build(config, device: str = "cpu", packed_documents: bool = False):
    return build_model(config.model, config.lora, None, config.data.vocab_size, param_dtype=torch.float32,
                       device=device, loss=config.train.loss, loss_chunk_tokens=config.train.loss_chunk_tokens,
                       tp=config.parallel.tp, pipeline=config.parallel.pp > 1,
                       packed_documents=packed_documents)


def meta_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    assert params and all(p.is_meta for p in params.values())
    return params


def test_a_llama_is_built_and_laid_out_for_8_ranks_at_tp_2():
    config = load_checked_config(None, LLAMA)
    shape = model_shape(config.model, config.data.vocab_size)
    built = build(config)
    assert not dist.is_initialized()
    assert (shape.model_type, shape.heads, shape.kv_heads, shape.layers) == ("llama", 4, 2, 2)
    assert shape.tp_problem is None and shape.pp_problem is None
    assert check_world(config, 8, 8, shape) == []
    layout = resolve_layout(config, 8, 8, shape)
    assert (layout.degree("tp"), layout.dp, layout.grad_accum) == (2, 4, 1)
    hf = built.hf_config
    assert (hf.model_type, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.num_hidden_layers,
            hf.vocab_size) == ("llama", 64, 4, 2, 2, 512)
    assert built.model.config is hf
    assert meta_parameters(built.model)["model.embed_tokens.weight"].shape == (512, 64)
    assert (built.attention, built.loss, built.notes) == ("sdpa", "full", [])


def test_a_gpt2_is_built_and_its_tp_refused_for_8_ranks():
    config = load_checked_config(None, GPT2)
    shape = model_shape(config.model, config.data.vocab_size)
    built = build(config)
    assert not dist.is_initialized()
    assert (shape.model_type, shape.heads, shape.kv_heads, shape.layers) == ("gpt2", 4, 4, 2)
    assert shape.tp_problem.startswith("parallel.tp = 'gpt2' has no tensor-parallel plan")
    assert shape.pp_problem is None
    assert check_world(config, 8, 8, shape) == [shape.tp_problem]
    hf = built.hf_config
    assert (hf.model_type, hf.n_embd, hf.n_head, hf.n_layer, hf.vocab_size) == ("gpt2", 64, 4, 2, 512)
    assert meta_parameters(built.model)["transformer.wte.weight"].shape == (512, 64)
    assert built.attention == "sdpa"


def test_a_gpu_run_is_planned_on_a_cpu_with_lora():
    """Only the device's type is read: a login node builds the model a GPU job will build."""
    config = load_checked_config(None, [*LLAMA, "lora.rank=4"])
    built = build(config, device="cuda", packed_documents=True)
    assert not dist.is_initialized()
    assert built.attention == "flex_attention"  # packed documents on a GPU in fp32: flash-attn computes in 16 bits
    assert built.model.config._attn_implementation == "flex_attention"
    trainable = [name for name, p in meta_parameters(built.model).items() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert built.loss == "full"  # a vocabulary of 512: no chunked loss


def test_a_model_config_problem_is_one_line_before_anything_is_built():
    with pytest.raises(ConfigError, match="^config error: model.config.num_key_value_heads = 3 does not divide "
                                          "model.config.num_attention_heads = 4$"):
        load_checked_config(None, [*LLAMA, "model.config.num_key_value_heads=3"])
