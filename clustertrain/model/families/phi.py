"""Phi (1, 1.5, 2): Llama's forward with dropout on the embeddings and a final LayerNorm named
`final_layernorm` (its head has a bias, which changes nothing here).

transformers ships its tp and pp plans.
"""

from clustertrain.model.families import Family, llama


def embed(stage, input_ids, position_ids):
    return stage.base.embed_dropout(stage.base.embed_tokens(input_ids))


def final(stage, hidden):
    return stage.base.final_layernorm(hidden)


FAMILY = Family(model_types=("phi",), embed=embed, decode=llama.rope_decoder(llama.full_attention), final=final,
                norms=("layers.*.input_layernorm", "final_layernorm"))
