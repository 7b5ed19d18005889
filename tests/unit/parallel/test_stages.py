"""Pipeline stages chained on one process compute what the full model computes, under the full model's names."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask
from transformers import AutoConfig, AutoModelForCausalLM

from clustertrain.errors import ConfigError
from clustertrain.model.spec import pipeline_plan
from clustertrain.model.weights import init_weights
from clustertrain.parallel.stages import build_stage, split_layers

VOCAB, LENGTH = 128, 12
ROPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ARCHS = {
    "llama": {**ROPE, "tie_word_embeddings": True},
    # windows shorter than a document; qwen2 mixes full (layers 0-1) and sliding layers (2-3) across stages
    "qwen2": {**ROPE, "use_sliding_window": True, "sliding_window": 3, "max_window_layers": 2},
    "mistral": {**ROPE, "sliding_window": 3},
    "qwen3": {**ROPE, "head_dim": 16},
    "phi3": ROPE,
    "gemma": {**ROPE, "head_dim": 16},
    "olmo": ROPE,
    "olmo2": ROPE,
    "smollm3": ROPE,
    "mixtral": {**ROPE, "sliding_window": 3, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {**ROPE, "head_dim": 16, "use_sliding_window": True, "sliding_window": 3, "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "qwen2_moe": {**ROPE, "use_sliding_window": True, "sliding_window": 3, "max_window_layers": 2, "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
    "phi": ROPE,
    "starcoder2": {**ROPE, "sliding_window": 3},
    # multipliers away from 1, so a stage that skipped one would give other logits
    "granite": {**ROPE, "embedding_multiplier": 3.0, "logits_scaling": 4.0, "residual_multiplier": 0.5,
                "attention_multiplier": 0.2},
    "gpt2": dict(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0),
    # word_embed_proj_dim != hidden_size adds project_in / project_out
    "opt": dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=4, num_attention_heads=4,
                max_position_embeddings=32, word_embed_proj_dim=32, pad_token_id=1, bos_token_id=2, eos_token_id=2),
}
# Two rows; documents restart mid-row, at different places in each row.
PACKED = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8]])


def build(arch: str, attn_implementation: str = "sdpa", device: str = "cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **ARCHS[arch]),
                                                 attn_implementation=attn_implementation, dtype=torch.float32)
    return model.eval()


def run(stages, input_ids, position_ids=None) -> torch.Tensor:
    """What a pipeline schedule does with one microbatch: each stage gets its predecessor's outputs."""
    outputs = (input_ids, position_ids)
    for stage in stages:
        outputs = stage(*outputs)
    return outputs


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: more threads only wait on each other, badly so on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("arch,attn_implementation", [(arch, "sdpa") for arch in ARCHS]
                         + [("llama", "eager"), ("qwen2", "eager"), ("gpt2", "eager"), ("opt", "eager")])
def test_chained_stages_give_the_full_models_logits(arch, attn_implementation, input_ids):
    model = build(arch, attn_implementation)
    with torch.no_grad():
        for num_stages in (2, 3, 4):
            stages = [build_stage(model, s, num_stages).eval() for s in range(num_stages)]
            for position_ids in (None, PACKED):
                expected = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
                got = run(stages, input_ids, position_ids)
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=0,
                                           msg=f"{num_stages} stages, packed={position_ids is not None}")


def test_packed_documents_stay_apart_across_stages(input_ids):
    model = build("llama")
    stages = [build_stage(model, s, 3) for s in range(3)]
    second = input_ids[:1, 5:]
    with torch.no_grad():
        alone = run(stages, second)
        packed = run(stages, input_ids[:1], PACKED[:1])[:, 5:]
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)


def test_stages_mask_packed_documents_with_flex_attention(input_ids):
    """Each stage builds flex_attention's BlockMasks (qwen2: full and sliding-window layers) from the positions
    that travel with the activations, and computes what the full model computes with sdpa's dense masks
    (forward only: no flex backward on CPU)."""
    torch._dynamo.reset()  # flex_attention compiles for these shapes alone: see test_attention.py's fresh_flex
    stages = [build_stage(build("qwen2", "flex_attention"), s, 2).eval() for s in range(2)]
    masks = []
    for stage in stages:
        for layer in stage.layers.values():
            layer.self_attn.register_forward_pre_hook(
                lambda module, args, kwargs: masks.append(kwargs["attention_mask"]), with_kwargs=True)
    with torch.no_grad():
        expected = build("qwen2")(input_ids=input_ids, position_ids=PACKED, use_cache=False).logits
        got = run(stages, input_ids, PACKED)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert len(masks) == 4 and all(isinstance(mask, BlockMask) for mask in masks)


@pytest.mark.parametrize("arch", ARCHS)
def test_stages_keep_the_full_models_names_and_share_only_the_tied_head(arch):
    model = build(arch, device="meta")
    full = {name for name, _ in model.named_parameters()}
    for num_stages in (1, 2, 3, 4):
        stages = [build_stage(model, s, num_stages) for s in range(num_stages)]
        names = [{name for name, _ in stage.named_parameters()} for stage in stages]
        tied = stages[0].tied_names
        assert all(stage.tied_names == tied for stage in stages)
        assert set().union(*names) == full | {head for head, _ in tied}
        assert sum(map(len, names)) == len(full) + len(tied), "a parameter is on two stages"
        for head, embedding in tied:
            assert embedding in names[0] and head in names[-1]
        assert [list(stage.layer_indices) for stage in stages] == list(map(list, split_layers(4, num_stages)))
    expect_tied = num_stages > 1 and model.config.tie_word_embeddings
    assert bool(tied) == expect_tied
    if tied:
        assert tied[0][0] == "lm_head.weight"


def test_positions_travel_with_the_hidden_states(input_ids):
    first, last = (build_stage(build("llama"), s, 2) for s in range(2))
    hidden, positions = first(input_ids)
    assert hidden.shape == (2, LENGTH, 64)
    assert positions.shape == (2, LENGTH) and positions.is_contiguous()
    assert torch.equal(positions, torch.arange(LENGTH).expand(2, -1))
    assert last(hidden, positions).shape == (2, LENGTH, VOCAB)
    _, passed_on = first(input_ids, PACKED)
    assert torch.equal(passed_on, PACKED)


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_meta_stages_allocate_nothing_and_materialize_like_the_full_model(arch, input_ids):
    meta = build(arch, device="meta")
    stages = [build_stage(meta, s, 2) for s in range(2)]
    assert all(t.is_meta for stage in stages for t in (*stage.parameters(), *stage.buffers()))
    assert all(t.is_meta for t in (*meta.parameters(), *meta.buffers())), "the full model must stay untouched"

    full = build(arch, device="meta")
    init_weights(full, torch.device("cpu"), seed=3)
    weights = full.state_dict()
    tied_heads = {head for head, _ in stages[0].tied_names}
    for stage in stages:
        init_weights(stage, torch.device("cpu"), seed=3)  # seeded by name: the same weights as the full model
        for name, tensor in stage.state_dict().items():
            assert name in tied_heads or torch.equal(tensor, weights[name]), name
        stage.load_state_dict({name: weights[name] for name in stage.state_dict()}, strict=True)
    with torch.no_grad():
        expected = full.eval()(input_ids=input_ids, position_ids=PACKED, use_cache=False).logits
        torch.testing.assert_close(run([s.eval() for s in stages], input_ids, PACKED), expected, atol=1e-5, rtol=0)


def test_split_layers_is_balanced_and_spares_the_first_and_last_stages():
    for num_layers in range(1, 33):
        for num_stages in range(1, num_layers + 1):
            split = split_layers(num_layers, num_stages)
            assert [i for r in split for i in r] == list(range(num_layers))
            sizes = [len(r) for r in split]
            assert max(sizes) - min(sizes) <= 1
            if num_stages > 2 and num_layers % num_stages <= num_stages - 2:
                assert sizes[0] == sizes[-1] == num_layers // num_stages
    assert split_layers(6, 4) == [range(0, 1), range(1, 3), range(3, 5), range(5, 6)]
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert split_layers(7, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]


def one_line_error(call) -> str:
    with pytest.raises(ConfigError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_too_many_stages_is_a_one_line_config_error():
    assert "5 stages for a model of 4 decoder layers" in one_line_error(lambda: split_layers(4, 5))
    model = build("llama", device="meta")
    assert "5 stages" in one_line_error(lambda: build_stage(model, 0, 5))


def test_unsupported_architectures_are_one_line_config_errors():
    bloom = AutoModelForCausalLM.from_config(AutoConfig.for_model("bloom", vocab_size=VOCAB, hidden_size=64, n_layer=2,
                                                                  n_head=4))
    message = one_line_error(lambda: build_stage(bloom, 0, 2))
    assert "'bloom'" in message and "pipeline parallel is not supported" in message
    with torch.device("meta"):  # ships a plan, but its forward (logit softcapping) is in no family file
        gemma2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma2", **ROPE))
    assert "embed_tokens" in pipeline_plan(gemma2.config)
    message = one_line_error(lambda: build_stage(gemma2, 0, 2))
    assert "'gemma2'" in message and "pipeline parallel is not supported" in message


def test_lora_stages_keep_peft_names_and_frozen_base():
    from clustertrain.config.schema import LoraConfig
    from clustertrain.lora import apply_lora, is_lora

    peft_model = apply_lora(build("llama", device="meta"), LoraConfig(rank=4, alpha=8))
    full = dict(peft_model.named_parameters())
    stages = [build_stage(peft_model, s, 4) for s in range(4)]
    names = [n for stage in stages for n, _ in stage.named_parameters()]
    assert all(is_lora(stage) for stage in stages)
    assert len(names) == len(set(names)) and set(names) >= set(full)  # the tied head: one copy more
    assert all(p.requires_grad == (".lora_" in n) for stage in stages for n, p in stage.named_parameters())
    assert stages[-1].tied_names[0][0] == "base_model.model.lm_head.weight"
