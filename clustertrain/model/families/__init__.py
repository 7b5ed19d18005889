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
        norms=(...),               # its norms, final norm included: sequence parallelism runs them on a slice
        positions=(...),           # learned position embeddings added to the token embedding's output
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
        norms: patterns of the modules that compute each token alone between the split linears: the norms (in
            the blocks: `*` for the index; the final norm) and any projection of the stream outside the blocks
            (OPT's). Sequence parallelism (`clustertrain.parallel.tp`) runs them on a tp rank's slice of the
            sequence; a family that declares none cannot run it. A pattern may match nothing in some models.
        positions: patterns of learned position embeddings, whose output joins the token embedding's before the
            first block, so sequence parallelism slices it the same way.
    """

    model_types: tuple[str, ...]
    embed: Callable[[Stage, torch.Tensor, torch.Tensor], torch.Tensor]
    decode: Callable[[Stage, torch.Tensor, torch.Tensor], torch.Tensor]
    final: Callable[[Stage, torch.Tensor], torch.Tensor]
    pp_plan: Plan | None = None
    tp_plan: dict[str, str] | None = None
    local_head_counts: dict[str, str] = field(default_factory=dict)
    norms: tuple[str, ...] = ()
    positions: tuple[str, ...] = ()


def stage_mask(mask_function: Callable, config: PretrainedConfig, hidden: torch.Tensor,
               position_ids: torch.Tensor | None = None):
    """`mask_function`'s mask (`transformers.masking_utils`) for a stage's layers: no padding mask, no cache.

    Its arguments have no defaults and were renamed (4.57's `input_embeds`, `past_key_values` and `cache_position`;
    5.24's `inputs_embeds` and `cache`), so they are named as the installed version names them.
    """
    names = _parameters(mask_function)
    args = {"config": config, "attention_mask": None, "position_ids": position_ids,
            "inputs_embeds" if "inputs_embeds" in names else "input_embeds": hidden,
            "cache" if "cache" in names else "past_key_values": None}
    if "cache_position" in names:  # nothing cached: the tokens sit at 0..n-1
        args["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
    return mask_function(**args)


@functools.cache
def _parameters(function: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


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
