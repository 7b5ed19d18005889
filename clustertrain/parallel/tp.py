"""Tensor parallelism from the model's own plan: transformers' `base_model_tp_plan`, or its family's
(`clustertrain.model.families`, e.g. OPT).

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

from clustertrain.config.checks import ModelShape
from clustertrain.config.schema import ModelConfig
from clustertrain.errors import ConfigError
from clustertrain.model.families import family_of
from clustertrain.model.load import build_hf_config
from clustertrain.parallel.stages import stage_family

STYLES: dict[str, ParallelStyle] = {
    "colwise": ColwiseParallel(),
    "rowwise": RowwiseParallel(),
    "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": RowwiseParallel(input_layouts=Replicate()),
}


def tp_plan(config) -> dict[str, str]:
    """The model's tensor-parallel plan, or a one-line error for an architecture we cannot split."""
    family = family_of(config.model_type)
    plan = getattr(config, "base_model_tp_plan", None) or (family and family.tp_plan)
    if not plan:
        raise ConfigError(f"parallel.tp = {config.model_type!r} has no tensor-parallel plan (its layers are not "
                          "plain linears we can split); use parallel.tp: 1")
    unknown = {s for s in plan.values() if s not in STYLES}
    if unknown:
        raise ConfigError(f"parallel.tp: the {config.model_type!r} plan uses styles {sorted(unknown)}, which "
                          f"clustertrain does not support (only {sorted(STYLES)}); use parallel.tp: 1")
    return plan


def model_shape(model: ModelConfig, vocab_size: int) -> ModelShape:
    """What clustertrain.config.checks needs of a model to check a layout: heads, layers, and whether tp and pp
    can split its family. From the snapshot's config.json, or model.arch and model.config: no weights, no
    tokenizer (`vocab_size` only completes a from-scratch config; it does not matter to the layout)."""
    config = build_hf_config(model, None, model.config_fields.get("vocab_size", vocab_size))

    def problem(plan) -> str | None:
        try:
            plan(config)
        except ConfigError as e:
            return str(e)
        return None

    heads = getattr(config, "num_attention_heads", None)
    return ModelShape(config.model_type, heads, getattr(config, "num_key_value_heads", None) or heads,
                      getattr(config, "num_hidden_layers", None), problem(tp_plan), problem(stage_family))


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split `model`'s linears over `tp_mesh` by its plan; LoRA adapters on those linears are split to match."""
    from clustertrain.lora import is_lora

    hf_model = model.get_base_model() if is_lora(model) else model
    config, base, tp = hf_model.config, hf_model.base_model, tp_mesh.size()
    assert not getattr(config, "num_attention_heads", 0) % tp, "clustertrain.config.checks refuses this at start"
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
