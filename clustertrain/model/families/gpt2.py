"""GPT-2: learned position embeddings, a causal mask that keeps packed documents apart, a final norm.

transformers ships no pp plan for it; it has no tp plan at all, because q, k and v are one fused `Conv1D`,
which cannot be split by heads (`parallel.tp > 1` is refused).
"""

from transformers.masking_utils import create_causal_mask

from clustertrain.model.families import Family, stage_mask


def embed(stage, input_ids, position_ids):
    return stage.base.drop(stage.base.wte(input_ids) + stage.base.wpe(position_ids))


def decode(stage, hidden, position_ids):
    mask = stage_mask(create_causal_mask, stage.config, hidden, position_ids)
    for block in stage.layers.values():
        hidden = block(hidden, attention_mask=mask, use_cache=False, position_ids=position_ids)
    return hidden


def final(stage, hidden):
    return stage.base.ln_f(hidden)


FAMILY = Family(
    model_types=("gpt2",), embed=embed, decode=decode, final=final,
    pp_plan={
        "wte": (["input_ids"], ["inputs_embeds"]),
        "wpe": (["position_ids"], ["position_embeds"]),
        "h": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "ln_f": (["hidden_states"], ["hidden_states"]),
    },
)
