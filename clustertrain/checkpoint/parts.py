"""A rank's model parts and their optimizers as one state dict, keyed by full-model names: what a checkpoint
holds under any layout (one whole model, or a rank's pipeline stages with one optimizer each)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.optim import Optimizer


def rank_state(parts: list[tuple[nn.Module, Optimizer | None]], options: StateDictOptions
               ) -> tuple[dict[str, Any], list[tuple[dict[str, Any], dict[str, Any]]], list[dict[str, Any]]]:
    """This rank's `{"model": ..., "optim": ...}` as DCP saves and loads it; also each part's own (model, optimizer)
    state dicts and its optimizer state under checkpoint names (a load writes back through them)."""
    states = [get_state_dict(module, optim, options=options) for module, optim in parts]
    renamed = [rename_optim_state(optim_state, tied_copies(module)) for (module, _), (_, optim_state) in zip(parts, states)]
    state = {"model": {k: v for model_state, _ in states for k, v in model_state.items()},
             "optim": merge_optim(renamed)}
    return state, states, renamed


def model_parts(model: nn.Module | list[nn.Module], optimizer) -> list[tuple[nn.Module, Optimizer | None]]:
    """(module, its optimizer) pairs: one for a whole model, one per stage for a rank's pipeline stages."""
    modules = model if isinstance(model, list) else [model]
    optimizers = getattr(optimizer, "optimizers", None) or [optimizer] * len(modules)
    assert len(optimizers) == len(modules), "one optimizer per pipeline stage"
    return list(zip(modules, optimizers))


def merge_optim(states: list[dict[str, Any]]) -> dict[str, Any]:
    """Stage optimizers' states as one optimizer's: the union of states, group j's parameters joined, so a
    checkpoint holds as many param groups under any pipeline layout (DCP stores each group by index)."""
    groups: list[dict[str, Any]] = []
    for optim_state in states:
        for j, group in enumerate(optim_state["param_groups"]):
            if j < len(groups):
                groups[j] = {**groups[j], "params": [*groups[j]["params"], *group["params"]]}
            else:
                groups.append(dict(group))
    return {"state": {k: v for optim_state in states for k, v in optim_state["state"].items()},
            "param_groups": groups}


def tied_copies(model: nn.Module) -> dict[str, str]:
    """The last pipeline stage's copies of tied weights (head name -> embedding name), else nothing.

    The full model's optimizer keeps a tied weight's state under the embedding's name only, so the last
    stage saves and loads its head's state under that name too: the first stage holds the same values
    (both copies take the same summed gradients), and checkpoints then move between layouts by name.
    """
    if getattr(model, "is_last", False) and not model.is_first:
        return dict(model.tied_names)
    return {}


def rename_optim_state(optim_state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """`optim_state` (get_state_dict's form: state and param_groups keyed by parameter name) with names replaced."""
    if not names:
        return optim_state
    return {
        "state": {names.get(k, k): v for k, v in optim_state["state"].items()},
        "param_groups": [{**g, "params": [names.get(n, n) for n in g["params"]]} for g in optim_state["param_groups"]],
    }
