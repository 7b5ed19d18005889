"""Tensor parallelism from the model's own plan: transformers' `base_model_tp_plan`, or its family's
(`clustertrain.model.families`, e.g. OPT), as `clustertrain.model.spec.tp_plan` finds it.

A plan maps module-name patterns (relative to the base model, `*` for a layer index) to styles. Column-wise
linears split their outputs over the tp ranks, row-wise linears their inputs and sum the results, so a block's
attention heads and MLP columns are divided among the ranks. Embeddings, norms and the head stay replicated.
"""

from __future__ import annotations

import re

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from clustertrain.errors import ConfigError
from clustertrain.model.families import family_of
from clustertrain.model.spec import TP_STYLES, tp_plan

STYLES: dict[str, ParallelStyle] = {
    "colwise": ColwiseParallel(),
    "rowwise": RowwiseParallel(),
    "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": RowwiseParallel(input_layouts=Replicate()),
}
assert set(STYLES) == set(TP_STYLES), "clustertrain.model.spec.TP_STYLES names the styles a plan may use"


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split `model`'s linears over `tp_mesh` by its plan; LoRA adapters on those linears are split to match."""
    from clustertrain.lora import is_lora

    hf_model = model.get_base_model() if is_lora(model) else model
    config, base, tp = hf_model.config, hf_model.base_model, tp_mesh.size()
    assert not getattr(config, "num_attention_heads", 0) % tp, "clustertrain.config.layout refuses this at start"
    plan = tp_plan(config)
    for pattern, style in plan.items():
        matched = [m for name, m in base.named_modules() if _matches(pattern, name)]
        if not matched:
            raise ConfigError(f"parallel.tp: no module of {config.model_type!r} matches its plan's {pattern!r}")
        for module in matched:
            _parallelize(module, style, tp_mesh)
    family = family_of(config.model_type)
    for pattern, attribute in (family.local_head_counts if family else {}).items():
        for name, module in base.named_modules():
            if _matches(pattern, name):
                setattr(module, attribute, getattr(module, attribute) // tp)


def _parallelize(module: nn.Module, style: str, tp_mesh: DeviceMesh) -> None:
    if not hasattr(module, "base_layer"):
        parallelize_module(module, tp_mesh, STYLES[style])
        return
    # A LoRA layer computes base(x) + B(A(x)). Column-wise: split B's outputs like the base's, keep A whole.
    # Row-wise: split A's inputs like the base's (A's output is then summed), keep B whole.
    parallelize_module(module.base_layer, tp_mesh, STYLES[style])
    split = module.lora_B if style.startswith("colwise") else module.lora_A
    for adapter in split.values():
        parallelize_module(adapter, tp_mesh, STYLES[style])


def _matches(pattern: str, name: str) -> bool:
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name) is not None
