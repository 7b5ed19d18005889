"""Sequence parallelism on 2 gloo ranks in one test: the norms hold a rank's slice of the sequence, and the
model computes what the unsplit model computes, forward and backward, for the families with a tp plan, and with
its blocks compiled (with and without sequence parallelism)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from clustertrain.distributed.spawn import free_port
from clustertrain.model.spec import norms
from clustertrain.parallel.compile import apply_compile
from clustertrain.parallel.tp import apply_tp

TP, BATCH, LENGTH = 2, 2, 12
SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
ARCHS = {
    "llama": SMALL,
    "qwen2": SMALL,
    # post-norm OPT (350m's layout) flattens the stream inside its blocks and norms after the residual add
    "opt": dict(vocab_size=96, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                word_embed_proj_dim=16, do_layer_norm_before=False, dropout=0.0),
}


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _rank(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    for arch in ARCHS:
        _check(arch)
    _check("llama", lora=True)
    for sequence_parallel in (True, False):  # the blocks compiled: what enters them is a plain tensor
        _check("llama", sequence_parallel=sequence_parallel, compiled=True)
    dist.destroy_process_group()


def _check(arch: str, lora: bool = False, sequence_parallel: bool = True, compiled: bool = False) -> None:
    config = AutoConfig.for_model(arch, **ARCHS[arch])
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config)
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(reference.state_dict())
    if lora:  # B starts random, so that every adapter weight takes a gradient
        adapters = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                              init_lora_weights=False)
        reference, model = get_peft_model(reference, adapters), get_peft_model(model, adapters)
        model.load_state_dict(reference.state_dict())
    apply_tp(model, init_device_mesh("cpu", (TP,)), sequence_parallel=sequence_parallel)
    if compiled:
        apply_compile(model, (type(model.model.layers[0]),), backend="aot_eager")
    slices = {}
    for name, module in (model.get_base_model() if lora else model).base_model.named_modules():
        if name.rsplit(".", 1)[-1] in {p.rsplit(".", 1)[-1] for p in norms(config)}:
            module.register_forward_hook(lambda m, args, out, name=name: slices.setdefault(name, out))
    ids = torch.randint(3, config.vocab_size, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    logits = _full(model(input_ids=ids).logits)
    expected = reference(input_ids=ids).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5, msg=arch)
    assert slices, "no norm ran"
    for name, out in slices.items() if sequence_parallel else ():  # in-block norms give the local slice, the final norm a Shard(1) DTensor
        local = out.to_local() if isinstance(out, DTensor) else out
        assert local.shape[:-1].numel() == BATCH * LENGTH // TP, (name, tuple(local.shape))
    logits.square().mean().backward()
    expected.square().mean().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert p.requires_grad == q.requires_grad, f"{arch}: {name} frozen or not as on one rank"
        if q.grad is not None:
            torch.testing.assert_close(_full(p.grad), q.grad, rtol=1e-4, atol=1e-6, msg=f"{arch} {name}")
    odd = ids[:, :LENGTH - 1]  # generation grows a sequence a token at a time: padded to a multiple of tp
    if compiled:
        return
    with torch.no_grad():
        torch.testing.assert_close(_full(model(input_ids=odd).logits), reference(input_ids=odd).logits,
                                   rtol=1e-5, atol=1e-5)


def test_sequence_parallel_slices_the_norms_and_computes_what_one_rank_computes():
    # forked: the ranks start with torch and transformers imported
    mp.start_processes(_rank, args=(free_port(),), nprocs=TP, start_method="fork")
