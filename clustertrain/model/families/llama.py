"""Llama and the models whose forward is Llama's apart from each layer's mask: rotary embeddings, causal or
sliding-window masks that keep packed documents apart (by position ids), a final norm.

transformers ships their tp and pp plans. A model type joins this family only once its modeling_<type>.py has
been read and found to be Llama's forward apart from the mask choice below.
"""

from collections.abc import Callable

from transformers import PretrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from clustertrain.model.families import Family, stage_mask


def full_attention(config: PretrainedConfig, index: int) -> str:
    return "full_attention"


def sliding_if_set(config: PretrainedConfig, index: int) -> str:
    return "full_attention" if config.sliding_window is None else "sliding_attention"


def _by_layer_type(config: PretrainedConfig, index: int) -> str:
    return config.layer_types[index]


# How each model's forward picks a layer's mask (MoE models included: their experts live inside the layers)
MASK_KIND = {
    "llama": full_attention, "gemma": full_attention, "olmo": full_attention, "olmo2": full_attention,
    "mistral": sliding_if_set, "phi3": sliding_if_set, "mixtral": sliding_if_set, "qwen3_moe": sliding_if_set,
    "qwen2": _by_layer_type, "qwen3": _by_layer_type, "qwen2_moe": _by_layer_type, "smollm3": _by_layer_type,
}
_MASK_FUNCTIONS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


def embed(stage, input_ids, position_ids):
    return stage.base.embed_tokens(input_ids)


def rope_decoder(mask_kind: Callable[[PretrainedConfig, int], str]):
    """A stage's `decode` for Llama's forward, in which layer `index` takes the mask `mask_kind(config, index)`."""

    def decode(stage, hidden, position_ids):
        config = stage.config
        kinds = {index: mask_kind(config, int(index)) for index in stage.layers}
        masks = {kind: stage_mask(_MASK_FUNCTIONS[kind], config, hidden, position_ids) for kind in set(kinds.values())}
        position_embeddings = stage.base.rotary_emb(hidden, position_ids=position_ids)
        for index, layer in stage.layers.items():
            hidden = layer(hidden, attention_mask=masks[kinds[index]], position_embeddings=position_embeddings,
                           position_ids=position_ids, use_cache=False)
        return hidden

    return decode


def final(stage, hidden):
    return stage.base.norm(hidden)


# The norms every model here names alike (olmo2 norms after attention and the MLP, not before: its names are
# among these); qk-norms inside attention see the gathered sequence and stay as they are.
NORMS = ("layers.*.input_layernorm", "layers.*.post_attention_layernorm", "layers.*.post_feedforward_layernorm",
         "norm")

FAMILY = Family(model_types=tuple(MASK_KIND), embed=embed, final=final,
                decode=rope_decoder(lambda config, index: MASK_KIND[config.model_type](config, index)), norms=NORMS)
