"""OPT: learned position embeddings (offset by 2), optional input and output projections and final norm, a
causal mask built without position ids (OPT attends across packed documents), layerdrop.

transformers ships neither a pp nor a tp plan for it. Its projections are plain linears, so it gets both here;
its attention reshapes by a head count kept as an attribute, which tensor parallelism makes the local one.
"""

import torch
from transformers.masking_utils import create_causal_mask

from clustertrain.model.families import Family, stage_mask

_ATTENTION = "decoder.layers.*.self_attn"


def embed(stage, input_ids, position_ids):
    decoder = stage.base.decoder
    embeds = decoder.embed_tokens(input_ids)
    if decoder.project_in is not None:
        embeds = decoder.project_in(embeds)
    # the module adds OPT's offset of 2 itself; the mask argument is only read when positions are None
    return embeds + decoder.embed_positions(None, 0, position_ids=position_ids)


def decode(stage, hidden, position_ids):
    # OPTDecoder builds its mask without position_ids
    mask = stage_mask(create_causal_mask, stage.config, hidden)
    layerdrop = stage.base.decoder.layerdrop
    for layer in stage.layers.values():
        if stage.training and layerdrop > 0.0 and torch.rand([]) < layerdrop:
            continue
        hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, use_cache=False)
    return hidden


def final(stage, hidden):
    decoder = stage.base.decoder
    if decoder.final_layer_norm is not None:
        hidden = decoder.final_layer_norm(hidden)
    if decoder.project_out is not None:
        hidden = decoder.project_out(hidden)
    return hidden


FAMILY = Family(
    model_types=("opt",), embed=embed, decode=decode, final=final,
    pp_plan={
        "decoder.embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "decoder.embed_positions": (["attention_mask", "position_ids"], ["position_embeds"]),
        "decoder.project_in": (["inputs_embeds"], ["inputs_embeds"]),  # None unless word_embed_proj_dim differs
        "decoder.layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "decoder.final_layer_norm": (["hidden_states"], ["hidden_states"]),  # None without do_layer_norm_before
        "decoder.project_out": (["hidden_states"], ["hidden_states"]),
    },
    tp_plan={
        f"{_ATTENTION}.q_proj": "colwise",
        f"{_ATTENTION}.k_proj": "colwise",
        f"{_ATTENTION}.v_proj": "colwise",
        f"{_ATTENTION}.out_proj": "rowwise",
        "decoder.layers.*.fc1": "colwise",
        "decoder.layers.*.fc2": "rowwise",
    },
    local_head_counts={_ATTENTION: "num_heads"},
    # project_in/out (None unless word_embed_proj_dim differs) map each token alone, as norms do
    norms=("decoder.layers.*.self_attn_layer_norm", "decoder.layers.*.final_layer_norm", "decoder.final_layer_norm",
           "decoder.project_in", "decoder.project_out"),
    positions=("decoder.embed_positions",),
)
