"""parallel.compile: each Llama and Qwen2 block compiles whole, with no graph breaks, plain, checkpointed and
with LoRA, forward and backward. The blocks are traced by dynamo and compiled with aot_eager, not inductor
(which only builds flex_attention's BlockMask, inside transformers)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from clustertrain.config.schema import LoraConfig
from clustertrain.lora import apply_lora
from clustertrain.model.build import block_classes
from clustertrain.parallel.ac import apply_activation_checkpointing
from clustertrain.parallel.compile import apply_compile
from clustertrain.model.loss import token_loss_sum

VOCAB = 128
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2)
# qwen2 with sliding-window layers after the first two: blocks of one class with two kinds of attention
ARCHS = {"llama": SMALL, "qwen2": {**SMALL, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}}
PACKED = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8]])
LAYOUTS = {"plain": ("none", False), "checkpointed": ("full", False), "lora": ("none", True),
           "lora+checkpointed": ("full", True), "selective": ("selective", False),
           "lora+selective": ("selective", True)}


class GraphCounter:
    """A torch.compile backend that records, per graph dynamo hands it, the linear layers it holds (inside
    an activation-checkpoint subgraph too), then compiles it with aot_eager (forward and backward traced)."""

    def __init__(self):
        self.linears: list[int] = []
        self.targets: set[str] = set()
        self.compile = lookup_backend("aot_eager")

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        nodes = [node for module in gm.modules() if isinstance(module, torch.fx.GraphModule)
                 for node in module.graph.nodes if node.op == "call_function"]
        self.linears.append(sum(node.target is torch._C._nn.linear for node in nodes))
        self.targets |= {str(node.target) for node in nodes}
        return self.compile(gm, example_inputs)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test traces from scratch (compiled code is cached per code object, across tests)."""
    torch._dynamo.reset()
    counters.clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch._dynamo.reset()


def build(arch: str, lora: bool = False):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **ARCHS[arch]), attn_implementation="sdpa")
    if lora:
        model = apply_lora(model, LoraConfig(rank=4))
        for name, param in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: no gradient would reach A
                torch.nn.init.normal_(param, std=0.02)
    return model


def parallelize(model, checkpointing: str, backend) -> int:
    """What clustertrain.parallel.apply does, in the same order, with a test backend."""
    blocks = block_classes(model)
    apply_activation_checkpointing(model, checkpointing, 1, blocks)
    return apply_compile(model, blocks, backend=backend)


def step(model, input_ids, position_ids=None) -> torch.Tensor:
    loss = token_loss_sum(model, input_ids, input_ids, position_ids)
    loss.backward()
    return loss.detach()


def graph_breaks() -> dict:
    return {reason.splitlines()[0]: n for reason, n in counters["graph_break"].items()}


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(0, VOCAB, (2, PACKED.shape[1]), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_blocks_compile_whole_without_graph_breaks(arch, layout, input_ids):
    checkpointing, lora = LAYOUTS[layout]
    model = build(arch, lora)
    names = [name for name, _ in model.named_parameters()]
    counter = GraphCounter()
    assert parallelize(model, checkpointing, counter) == ARCHS[arch]["num_hidden_layers"]
    step(model, input_ids)  # rows of one document each
    step(model, input_ids, PACKED)  # packed documents: the blocks get a mask
    graphs = len(counter.linears)
    step(model, input_ids, PACKED)
    assert graph_breaks() == {}
    # Each graph holds a whole block: q, k, v, o, gate, up, down (+ A and B per LoRA linear).
    per_block = 7 * (3 if lora else 1)
    assert counter.linears and all(n == per_block for n in counter.linears), counter.linears
    assert len(counter.linears) == graphs, "a repeated step compiled again"
    # One graph per kind of call, never one per block: with and without a mask (and qwen2's sliding-window
    # mask), and under LoRA again for the first block, whose input needs no gradient.
    kinds = {"llama": 2, "qwen2": 3}[arch]
    assert graphs <= kinds + 2 * lora < ARCHS[arch]["num_hidden_layers"]
    assert [name for name, _ in model.named_parameters()] == names, "compiling renamed a parameter"


def test_blocks_with_flex_attention_compile_whole(input_ids):
    """The GPU path for packed documents: the BlockMask goes into the compiled blocks, and flex_attention is
    traced into their graphs (forward only: torch has no FlexAttention backward on CPU)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **SMALL)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flex_attention").eval()
    counter = GraphCounter()
    parallelize(model, "full", counter)
    with torch.no_grad():
        for _ in range(2):
            token_loss_sum(model, input_ids, input_ids, PACKED)
    assert graph_breaks() == {}
    assert counter.linears == [7]
    assert "flex_attention" in counter.targets


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_compiled_checkpointed_blocks_give_eager_gradients(input_ids, checkpointing):
    eager, compiled = build("qwen2"), build("qwen2")
    parallelize(compiled, checkpointing, GraphCounter())
    expected, got = step(eager, input_ids, PACKED), step(compiled, input_ids, PACKED)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_deep_copy_of_a_checkpointed_model_runs_its_own_blocks():
    model = build("llama")
    apply_activation_checkpointing(model, "full", 1, block_classes(model))
    clone = copy.deepcopy(model)
    assert all(layer.forward.forward.__self__ is layer for layer in clone.model.layers)


def saved_activations(model, input_ids) -> int:
    """Elements autograd keeps from forward for backward, parameters not counted."""
    params = {p.data_ptr() for p in model.parameters()}
    saved = []

    def pack(tensor):
        if tensor.data_ptr() not in params:
            saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = token_loss_sum(model, input_ids, input_ids)
    loss.backward()
    return sum(saved)


def test_compiled_blocks_still_recompute_their_activations(input_ids):
    plain, checkpointed = build("llama"), build("llama")
    parallelize(plain, "none", GraphCounter())
    parallelize(checkpointed, "full", GraphCounter())
    assert saved_activations(checkpointed, input_ids) < saved_activations(plain, input_ids) / 2


def test_a_graph_break_inside_a_checkpointed_block_is_counted(input_ids):
    """The counters the tests above read do see a break in the checkpointed region (the whole block then runs
    uncompiled, as it did when checkpointing was a functools.partial)."""
    model = build("llama")
    blocks = block_classes(model)
    for block in model.modules():
        if isinstance(block, blocks):
            block.mlp.forward = _with_graph_break(block.mlp.forward)
    counter = GraphCounter()
    apply_activation_checkpointing(model, "full", 1, blocks)
    apply_compile(model, blocks, backend=counter)
    step(model, input_ids)
    assert graph_breaks()
    assert counter.linears == [], "the block ran compiled despite the break"


def _with_graph_break(forward):
    def broken(*args, **kwargs):
        torch._dynamo.graph_break()
        return forward(*args, **kwargs)

    return broken


def test_fsdp_hooks_stay_outside_the_compiled_blocks(input_ids):
    """Under FSDP2 (one rank, gloo) the blocks still compile whole: its all-gather hooks run eagerly around them."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build("llama")
        counter = GraphCounter()
        parallelize(model, "full", counter)
        for block in model.model.layers:
            fully_shard(block)
        fully_shard(model)
        for _ in range(2):
            step(model, input_ids, PACKED)
        assert graph_breaks() == {}
        assert counter.linears == [7]
    finally:
        dist.destroy_process_group()
