"""Pipeline-parallel stages of a Hugging Face causal LM, for `torch.distributed.pipelining`.

A stage keeps a contiguous run of decoder layers; the first stage also keeps the embeddings, the last
the final norm and the head. Each is built from the full model (on the meta device: nothing is allocated)
and computes exactly what the full model computes for its part, masks for packed documents included:

    stages = [build_stage(meta_model, s, num_stages) for s in stages_of_this_rank]
    pipe = [PipelineStage(m, m.stage_index, num_stages, device) for m in stages]
    schedule = ScheduleGPipe(pipe[0], n_microbatches, loss_fn=..., scale_grads=False)  # or 1F1B, Interleaved1F1B
    schedule.step(input_ids, position_ids, target=labels)  # inputs on stage 0's rank, target on the last's

Inputs and outputs, per microbatch of b rows of t tokens:

- stage 0 takes `(input_ids [b, t], position_ids [b, t] or None)`; None means 0..t-1 in every row.
- a later stage takes what its predecessor returned, `(hidden [b, t, h], position_ids [b, t])`:
  pipelining hands the microbatch to the first stage only, so the positions, which every stage needs
  for its masks and rotary embeddings, travel with the activations (t int64 per row, no gradient). Under
  sequence parallelism the hidden states sent are the tp rank's slice, `[b, t/tp, h]`: clustertrain.parallel.tp
  hooks a stage's ends to send the slice and take it back as the whole sequence's `Shard(1)` DTensor.
- every stage but the last returns `(hidden, position_ids)`; the last returns the logits [b, t, vocab].
- the last stage also takes `labels [b, t]` as a keyword (`schedule.step(..., labels=...)` on its rank:
  keywords reach every stage of the rank that passes them, split into microbatches like the inputs, and
  real ones, unlike activations, reach the schedule's first trial forward). A head that computes the loss
  (`clustertrain.model.loss.LossHead`, which marks itself with `takes_targets`) then returns the summed loss
  as a 1-element tensor instead of logits: no full logits exist. Other stages ignore labels.

The forward of each model family (embeddings, how the layers are called and masked, final norm) comes from its
file in `clustertrain.model.families`, which also says where its pieces are when transformers ships no
`base_model_pp_plan`.

Parameters keep the full model's names (`model.layers.3.self_attn.q_proj.weight`): the layer list
becomes an `nn.ModuleDict` keyed by the original indices, so a checkpoint written under any pipeline
layout loads under any other, and under none, by name. Modules without parameters (rotary embeddings,
dropout) are kept on every stage.

Tied embeddings: when the head shares its weight with the input embedding (GPT-2, OPT and some small
Llama-family configs), the last stage keeps its own copy under the head's name (`lm_head.weight`).
`stage.tied_names` lists the `(head name, embedding name)` pairs that live on different stages. The
trainer must make both copies equal after materializing (copy the first stage's embedding to the last
stage's head: initialization is seeded by module name, and HF snapshots of tied models store only the
embedding) and sum their gradients between the first and last stage before each update.

LoRA: pass the peft-wrapped model (`peft.PeftModel`). The stage is then a `LoraStage`, which holds the
stage under peft's prefix, so its names are the PeftModel's (`base_model.model.model.layers.3.self_attn.
q_proj.lora_A.default.weight`) and LoRA checkpoints move between pp and no pp, and export as an adapter.

With clustertrain's loss (summed, divided by the global token count) pass `scale_grads=False` to the
schedule: by default it also divides the gradients by the number of microbatches.
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn
from transformers import PreTrainedModel

from clustertrain.errors import ConfigError
from clustertrain.lora import is_lora
from clustertrain.model.families import Family, Plan
from clustertrain.model.spec import pipeline_plan, stage_family


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage, whose sizes differ by at most one.

    The layers left over by an even split go to the middle stages first (1, 2, ...), then to the first
    stage, and to the last only when every other stage has one: the last stage also computes the head
    and the loss (about 2·h·vocab FLOPs per token, several layers' worth for a large vocabulary) while
    the first stage's embedding is a lookup. With an interleaved schedule, pass the total number of
    stages (pipeline degree × stages per rank).

    Raises:
        ConfigError: more stages than layers (every stage needs one).
    """
    if not 1 <= num_stages <= num_layers:
        raise ConfigError(f"pipeline parallel: {num_stages} stages for a model of {num_layers} decoder layers; "
                          "each stage needs at least one layer")
    base, extra = divmod(num_layers, num_stages)
    order = [*range(1, num_stages - 1), 0, *([num_stages - 1] if num_stages > 1 else [])]
    sizes = [base + (s in order[:extra]) for s in range(num_stages)]
    starts = list(itertools.accumulate(sizes, initial=0))
    return [range(start, end) for start, end in zip(starts, starts[1:])]


def build_stage(model: PreTrainedModel, stage_index: int, num_stages: int) -> PipelineStageModule | LoraStage:
    """Stage `stage_index` of `num_stages` of the causal LM `model` (any device, meta included; left unchanged).

    A peft-wrapped `model` gives a `LoraStage` under peft's parameter names.

    The stage is a deep copy of only the modules it keeps, so building on the meta device allocates
    nothing, and building from a real model copies only this stage's weights.

    Raises:
        ConfigError: the architecture is not supported, or there are more stages than layers.
    """
    if is_lora(model):
        return LoraStage(build_stage(model.get_base_model(), stage_index, num_stages))
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"build_stage needs a Hugging Face model, got {type(model).__name__}")
    family = stage_family(model.config)
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index {stage_index} is not in [0, {num_stages})")
    layout = _Layout.of(model, pipeline_plan(model.config))
    split = split_layers(len(layout.layer_list(model)), num_stages)
    layers = split[stage_index]
    first, last = stage_index == 0, stage_index == num_stages - 1

    dropped = [layer for i, layer in enumerate(layout.layer_list(model)) if i not in layers]
    dropped += [] if first else [model.get_submodule(path) for path in layout.first]
    dropped += [] if last else [model.get_submodule(path) for path in layout.last]
    kept = copy.deepcopy(model, memo={id(m): None for m in dropped})  # a dropped module is copied as None
    for path in ([] if first else layout.first) + ([] if last else layout.last):
        parent, _, name = path.rpartition(".")
        delattr(kept.get_submodule(parent), name)
    parent, _, name = layout.layers.rpartition(".")
    layer_list = kept.get_submodule(layout.layers)
    setattr(kept.get_submodule(parent), name, nn.ModuleDict({str(i): layer_list[i] for i in layers}))

    tied = [(head, embedding) for head, embedding in _tied_pairs(model)
            if layout.owner(head, split) != layout.owner(embedding, split)]
    stage = PipelineStageModule(kept, family, layout, stage_index, num_stages, layers, tied)
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    assert {n for n, _ in stage.named_parameters(remove_duplicate=False)} <= names, "a stage renamed a parameter"
    return stage


class PipelineStageModule(nn.Module):
    """One pipeline stage: the full model's modules that this stage keeps, under their original names, run by
    its family's stage forward (`clustertrain.model.families`).

    Attributes:
        stage_index, num_stages: this stage's place in the pipeline.
        layer_indices: the decoder layers it keeps (indices in the full model).
        tied_names: (head name, embedding name) pairs of one weight shared in the full model that live on
            different stages here; the first stage holds the embedding, the last the head.
        config: the model's HF config.
        family: the model family whose `embed`, `decode` and `final` mirror the base model's forward.
    """

    def __init__(self, kept: PreTrainedModel, family: Family, layout: _Layout, stage_index: int, num_stages: int,
                 layer_indices: range, tied_names: list[tuple[str, str]]):
        super().__init__()
        for name, child in kept.named_children():
            self.add_module(name, child)
        self.config, self.family = kept.config, family
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.layer_indices = layer_indices
        self.tied_names = tied_names
        self.base_model_prefix, self._layers = kept.base_model_prefix, layout.layers

    @property
    def base(self) -> PreTrainedModel:
        """The (pruned) HF base model, e.g. `LlamaModel`."""
        return getattr(self, self.base_model_prefix)

    @property
    def base_model(self) -> PreTrainedModel:
        """The base model under HF's name for it, so code written for a whole HF model (tp plans) takes a stage."""
        return self.base

    @property
    def layers(self) -> nn.ModuleDict:
        """This stage's decoder layers, keyed by their index in the full model."""
        return self.get_submodule(self._layers)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None):
        """Input ids (first stage) or hidden states -> `(hidden, position_ids)`; on the last stage the logits,
        or the summed loss [1] when given `labels` and the head computes it."""
        batch, length = x.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(length, device=x.device)
        position_ids = position_ids.expand(batch, length).contiguous()  # sent on, so one row per sample
        hidden = self.family.embed(self, x, position_ids) if self.is_first else x
        hidden = self.family.decode(self, hidden, position_ids)
        if not self.is_last:
            return hidden, position_ids
        return self._lm_head(self.family.final(self, hidden), labels)

    def _init_weights(self, module: nn.Module) -> None:
        """The model's own initialization, so `clustertrain.model.weights.init_weights` can materialize a stage."""
        self.base._init_weights(module)

    def _lm_head(self, hidden: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """The head's logits, or its summed loss against `labels` when it computes one."""
        if labels is None or not getattr(self.lm_head, "takes_targets", False):
            return self.lm_head(hidden).contiguous()  # as OPTForCausalLM's; a no-op for the others
        out = self.lm_head(hidden, targets=labels)
        # one element, not a scalar: the schedule concatenates the microbatches' outputs
        return out.reshape(1) if out.dim() == 0 else out


class LoraStage(nn.Module):
    """A stage of a peft-wrapped model, under peft's names: `base_model.model.<the stage's name>`.

    Stands in for the PeftModel wherever clustertrain handles one (`clustertrain.lora.is_lora`): tensor
    parallelism, snapshot loading and `start_as_identity` reach the stage through `get_base_model()`.
    """

    def __init__(self, stage: PipelineStageModule):
        super().__init__()
        self.base_model = nn.Module()
        self.base_model.model = stage
        self.config = stage.config
        self.stage_index, self.num_stages = stage.stage_index, stage.num_stages
        self.is_first, self.is_last = stage.is_first, stage.is_last
        self.layer_indices = stage.layer_indices
        self.tied_names = [(f"base_model.model.{head}", f"base_model.model.{embedding}")
                           for head, embedding in stage.tied_names]

    def get_base_model(self) -> PipelineStageModule:
        """The stage itself, as `PeftModel.get_base_model()` gives the HF model."""
        return self.base_model.model

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None):
        return self.base_model.model(x, position_ids, labels)

    def _init_weights(self, module: nn.Module) -> None:
        self.base_model.model._init_weights(module)


class _Layout:
    """Module paths (from the causal LM) of what goes only on the first stage, the layer list, and what goes
    only on the last stage (final norm, head)."""

    def __init__(self, first: list[str], layers: str, last: list[str]):
        self.first, self.layers, self.last = first, layers, last
        self.first_prefixes = tuple(path + "." for path in first)
        self.last_prefixes = tuple(path + "." for path in last)

    @classmethod
    def of(cls, model: PreTrainedModel, plan: Plan) -> _Layout:
        prefix = model.base_model_prefix
        paths = [f"{prefix}.{key}" for key in plan if _has(model, f"{prefix}.{key}")]
        lists = [i for i, path in enumerate(paths) if isinstance(model.get_submodule(path), nn.ModuleList)]
        assert len(lists) == 1, f"{model.config.model_type}: the plan names {len(lists)} layer lists"
        head = next(iter(getattr(type(model), "_pp_plan", None) or {"lm_head": None}))
        layout = cls(paths[:lists[0]], paths[lists[0]], [*paths[lists[0] + 1:], head])
        planned = (*layout.first_prefixes, layout.layers + ".", *layout.last_prefixes)
        unplanned = [name for name, _ in model.named_parameters() if not name.startswith(planned)]
        assert not unplanned, f"{model.config.model_type}: parameters outside the plan: {unplanned[:3]}"
        return layout

    def layer_list(self, model: nn.Module) -> nn.ModuleList:
        return model.get_submodule(self.layers)

    def owner(self, name: str, split: list[range]) -> int:
        """The stage that holds the parameter `name` of the full model."""
        if name.startswith(self.first_prefixes):
            return 0
        if name.startswith(self.last_prefixes):
            return len(split) - 1
        index = int(name[len(self.layers) + 1:].split(".")[0])
        return next(stage for stage, layers in enumerate(split) if index in layers)


def _has(model: nn.Module, path: str) -> bool:
    """Whether `path` names a module (OPT's optional projections and final norm may be None)."""
    parent, _, name = path.rpartition(".")
    return getattr(model.get_submodule(parent), name, None) is not None


def _tied_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """(later name, first name) of every parameter the model holds under two names, e.g. ("lm_head.weight",
    "model.embed_tokens.weight")."""
    first_name: dict[int, str] = {}
    pairs = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            pairs.append((name, first_name[id(param)]))
        else:
            first_name[id(param)] = name
    return pairs
