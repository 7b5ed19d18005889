"""StarCoder2: Llama's forward with dropout on the embeddings (`embedding_dropout`, a probability) and a
sliding-window mask when `sliding_window` is set.

transformers ships its tp and pp plans.
"""

from torch.nn import functional as F

from clustertrain.model.families import Family, llama


def embed(stage, input_ids, position_ids):
    return F.dropout(stage.base.embed_tokens(input_ids), p=stage.base.embedding_dropout, training=stage.training)


FAMILY = Family(model_types=("starcoder2",), embed=embed, decode=llama.rope_decoder(llama.sliding_if_set),
                final=llama.final, norms=llama.NORMS)
