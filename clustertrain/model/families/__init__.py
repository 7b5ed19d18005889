"""What clustertrain knows of each model family beyond what transformers ships: one file per family.

transformers ships most of what parallelism needs: a model's `base_model_tp_plan` (which linears split
column- or row-wise) and `base_model_pp_plan` (where its embeddings, decoder layers and final norm are). A
family file adds what is missing for its model types, and the forward of a pipeline stage, which transformers
does not offer: a stage calls its decoder layers itself, so it mirrors the base model's forward in three pieces.

    FAMILY = Family(
        model_types=("gpt2",),
        embed=embed, decode=decode, final=final,  # a pipeline stage's forward (clustertrain.parallel.stages)
        pp_plan={...},             # only where transformers ships no base_model_pp_plan
        tp_plan={...},             # only where it ships no base_model_tp_plan
        local_head_counts={...},   # attention modules that keep their head count as an attribute
    )

Adding a family means adding a file here that defines `FAMILY`; `family_of` finds it. A model type without a
family still trains whole, under DDP or FSDP, and tensor-parallel when transformers ships its plan; pipeline
parallel needs a family. Two choices stay with the libraries that make them: which types liger-kernel fuses
(its own table, `clustertrain.model.kernels`) and which heads the chunked loss may replace
(`clustertrain.model.loss.PLAIN_HEAD_MODELS`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

# A base-model plan in the form of transformers' `base_model_pp_plan`: module path -> (input names, output names).
# Entries before the layer list belong to the first stage, those after it to the last.
Plan = dict[str, tuple[list[str], list[str]]]


class Stage(Protocol):
    """What a family's stage forward may use of its pipeline stage (`clustertrain.parallel.stages`)."""

    config: PretrainedConfig
    training: bool

    @property
    def base(self) -> PreTrainedModel:
        """The pruned HF base model (`LlamaModel`, ...): embeddings on the first stage, final norm on the last."""

    @property
    def layers(self) -> nn.ModuleDict:
        """The stage's decoder layers, keyed by their index in the full model."""


@dataclass(frozen=True)
class Family:
    """One model family: its model types, its pipeline stage forward, and the plans transformers lacks.

    Attributes:
        model_types: the HF `model_type`s whose forward this family's pieces mirror.
        embed: `(stage, input_ids [b, t], position_ids [b, t]) -> hidden`, on the first stage.
        decode: `(stage, hidden, position_ids) -> hidden` through the stage's layers, masks and rotary included.
        final: `(stage, hidden) -> hidden` before the head, on the last stage (final norm, projections).
        pp_plan: where the base model keeps its pieces, when transformers ships no `base_model_pp_plan`.
        tp_plan: module pattern -> style (`clustertrain.model.spec.TP_STYLES`), when it ships no `base_model_tp_plan`.
        local_head_counts: attention module pattern -> the attribute holding its head count, which tensor
            parallelism divides by the degree (a module that reshapes by that count).
    """

    model_types: tuple[str, ...]
    embed: Callable[[Stage, torch.Tensor, torch.Tensor], torch.Tensor]
    decode: Callable[[Stage, torch.Tensor, torch.Tensor], torch.Tensor]
    final: Callable[[Stage, torch.Tensor], torch.Tensor]
    pp_plan: Plan | None = None
    tp_plan: dict[str, str] | None = None
    local_head_counts: dict[str, str] = field(default_factory=dict)


def stage_mask(mask_function: Callable, config: PretrainedConfig, hidden: torch.Tensor,
               position_ids: torch.Tensor | None = None):
    """`mask_function`'s mask (`transformers.masking_utils`) for a stage's layers: no padding mask, no cache.

    The cache argument has no default and was renamed (`past_key_values` -> `cache` in transformers 5.24), so it
    is named as the installed version names it.
    """
    return mask_function(config=config, inputs_embeds=hidden, attention_mask=None, position_ids=position_ids,
                         **{_cache_argument(mask_function): None})


@functools.cache
def _cache_argument(function: Callable) -> str:
    return "cache" if "cache" in inspect.signature(function).parameters else "past_key_values"


def family_of(model_type: str) -> Family | None:
    """The family of `model_type`, or None when clustertrain has none for it."""
    return families().get(model_type)


@functools.cache
def families() -> dict[str, Family]:
    """Every model type with a family, from the files of this package."""
    found: dict[str, Family] = {}
    for module in pkgutil.iter_modules(__path__):
        family = importlib.import_module(f"{__name__}.{module.name}").FAMILY
        for model_type in family.model_types:
            assert model_type not in found, f"model type {model_type!r} is in two family files"
            found[model_type] = family
    return found
