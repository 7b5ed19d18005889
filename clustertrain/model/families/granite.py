"""IBM Granite (3.x): Llama's forward with multipliers. The embeddings are scaled by `embedding_multiplier`
(attention and residual multipliers live inside the layers), every layer is causal, and the logits are divided
by `logits_scaling` after the head.

transformers ships its tp and pp plans. Its head has no bias, so dividing the hidden states before the head
divides the logits: the last stage's head stays a plain linear (and takes the chunked loss under pp).
"""

from clustertrain.model.families import Family, llama


def embed(stage, input_ids, position_ids):
    return stage.base.embed_tokens(input_ids) * stage.config.embedding_multiplier


def final(stage, hidden):
    return stage.base.norm(hidden) / stage.config.logits_scaling


FAMILY = Family(model_types=("granite",), embed=embed, decode=llama.rope_decoder(llama.full_attention), final=final,
                norms=llama.NORMS)
