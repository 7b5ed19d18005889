"""The vocabulary-sharded embedding and head (clustertrain.parallel.vocab) on 2 real gloo ranks: each rank holds
[V/tp, H] of the head and [..., V/tp] of the logits, and the loss, every gradient and the gathered logits are one
rank's, for Llama, Qwen2 and OPT (a tied head), plain and with LoRA, chunked and full loss."""

from __future__ import annotations

import copy
import os

import pytest
import torch

pytestmark = pytest.mark.dist

VOCAB = 251  # odd: split as torch.chunk splits it, 126 + 125 rows
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
ARCHS = {
    "llama": dict(SMALL, intermediate_size=128, num_key_value_heads=2),
    "qwen2": dict(SMALL, intermediate_size=128, num_key_value_heads=2),
    "opt": dict(SMALL, ffn_dim=128, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0, pad_token_id=1),
}


def _build(arch: str, lora: bool, loss: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    from clustertrain.config.schema import LoraConfig
    from clustertrain.lora import apply_lora
    from clustertrain.model.loss import apply_loss_head

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **ARCHS[arch]), attn_implementation="sdpa")
    if lora:
        model = apply_lora(model, LoraConfig(rank=4))
        for name, param in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: no gradient would reach A
                torch.nn.init.normal_(param, std=0.02)
    assert apply_loss_head(model, loss, chunk_tokens=7)[0] == loss
    return model


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _rank(rank: int, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from clustertrain.data.pack import IGNORE_INDEX
    from clustertrain.lora import is_lora
    from clustertrain.model.loss import full_logits, token_loss_sum
    from clustertrain.parallel.vocab import shard_vocabulary

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, 1)
    labels[:, -1] = IGNORE_INDEX
    labels[0, :3] = IGNORE_INDEX
    for arch in ARCHS:
        for lora in (False, True):
            for loss in ("chunked", "full"):
                case = f"{arch} lora={lora} loss={loss}"
                reference = _build(arch, lora, loss)
                model = copy.deepcopy(reference)
                hf = model.get_base_model() if is_lora(model) else model
                shard_vocabulary(hf, mesh, sequence_parallel=False)  # the blocks stay whole: tp.py's, tested there
                embedding = hf.base_model.get_input_embeddings()
                assert hf.lm_head.weight.to_local().shape == ((126, 64) if rank == 0 else (125, 64)), case
                assert embedding.weight.to_local().shape == hf.lm_head.weight.to_local().shape, case
                assert (hf.lm_head.weight is embedding.weight) == (arch == "opt"), case  # the tie survives
                logits = model(input_ids=ids).logits
                assert logits.to_local().shape == (2, 12, 126 - rank), case
                assert torch.allclose(full_logits(logits), reference(input_ids=ids).logits, atol=1e-5), case

                expected = token_loss_sum(reference, ids, labels)
                got = token_loss_sum(model, ids, labels)
                assert torch.allclose(got, expected, rtol=1e-5), (case, got, expected)
                expected.backward()
                got.backward()
                grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
                for name, param in reference.named_parameters():
                    if param.requires_grad:
                        assert torch.allclose(_full(grads[name]), param.grad, rtol=1e-4, atol=1e-6), (case, name)
    dist.destroy_process_group()


def test_sharded_vocabulary_computes_what_one_rank_computes():
    import torch.multiprocessing as mp

    from clustertrain.distributed.spawn import free_port

    mp.start_processes(_rank, args=(free_port(),), nprocs=2, start_method="spawn")
