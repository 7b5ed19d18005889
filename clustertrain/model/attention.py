"""Which attention kernel a run uses (`model.attn_implementation`), and keeping packed documents apart with it.

    attn = resolve_attention(model.attn_implementation, hf_config, device.type, dtype=torch.bfloat16,
                             packed_documents=data.packed_documents, pipeline=parallel.pp > 1)
    meta = build_meta_model(hf_config, lora, base_dtype, attn)   # clustertrain.model.build

`auto` is sdpa, except on a GPU when attention must stay inside the documents packed into a row (position
ids that restart inside the row: `data.doc_masking`, or SFT). sdpa then gets a dense mask, which rules out
its flash kernel, so those runs take flash_attention_2 when flash-attn is installed, else flex_attention.

How transformers 5 keeps packed documents apart (`masking_utils.create_causal_mask`), per kernel:

- sdpa, eager: one dense [batch, 1, seq, seq] mask per forward (boolean for sdpa, additive float for
  eager), built from the restarts and shared by the layers.
- flex_attention: the same mask function turned into a `BlockMask` (block indices, no dense mask); blocks
  outside every document are skipped.
- flash_attention_2: no mask; the kernel takes the documents as cumulative lengths (`flash_attn_varlen_func`).
  transformers derives them from position_ids only for a single row, so with several rows it would attend
  across documents: `keep_packed_documents_apart` passes the lengths of every row's documents itself.

How many documents a batch holds is a number the host needs (it sizes the lengths), and finding it on the
GPU would make the host wait for the GPU at every forward. The loader finds them on the host
(`clustertrain.data.pack.document_bounds`) and the trainer hands them over with the batch (`use_documents`).
Whether rows are packed at all, which transformers would also ask the GPU, the loss tells it (`rows_packed`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from clustertrain.errors import ConfigError

KEY = "model.attn_implementation"


def resolve_attention(choice: str, hf_config: PretrainedConfig, device_type: str, *, dtype: torch.dtype,
                      packed_documents: bool, pipeline: bool = False) -> str:
    """The attention kernel to build the model with: `choice` (`model.attn_implementation`), auto decided.

    Args:
        choice: auto, sdpa, flash_attention_2, flex_attention or eager.
        hf_config: the model's HF config (some families support neither flash-attn nor flex).
        device_type: the run's device type ("cuda" on ROCm too).
        dtype: the compute dtype (`parallel.param_dtype`); flash-attn computes in bfloat16 or float16 only.
        packed_documents: attention must stay inside the documents packed into a row.
        pipeline: pipeline stages (`parallel.pp > 1`), which call the decoder layers themselves.

    Raises:
        ConfigError: an explicit choice that cannot run or train here, in one line that says what would.
    """
    supports = _supported(hf_config)
    arch = hf_config.model_type
    if choice == "auto":
        if device_type != "cuda" or not packed_documents:
            return "sdpa"
        flash_fits = "flash_attention_2" in supports and not pipeline and dtype != torch.float32
        if flash_fits and _flash_attn_problem() is None:
            return "flash_attention_2"
        return "flex_attention" if "flex_attention" in supports else "sdpa"
    if choice in ("flash_attention_2", "flex_attention") and choice not in supports:
        raise ConfigError(f"{KEY} = {choice}: transformers has no {choice} for {arch}; use auto or sdpa")
    if choice == "flash_attention_2":
        if device_type != "cuda":
            raise ConfigError(f"{KEY} = flash_attention_2 needs a CUDA or ROCm GPU and this run is on {device_type}; "
                              "use auto or sdpa")
        problem = _flash_attn_problem()
        if problem is None and dtype == torch.float32:
            problem = "computes in bfloat16 or float16 only (set parallel.param_dtype: bfloat16)"
        if problem is None and pipeline and packed_documents:
            problem = "does not keep packed documents apart in pipeline stages (parallel.pp > 1)"
        if problem:
            raise ConfigError(f"{KEY} = flash_attention_2 {problem}; use auto, flex_attention or sdpa")
    if choice == "flex_attention" and device_type == "cpu" and not _flex_attention_trains_on_cpu():
        raise ConfigError(f"{KEY} = flex_attention cannot train on CPU (torch {torch.__version__} has no "
                          "FlexAttention backward there); use auto or sdpa, which mask packed documents exactly")
    return choice


def keep_packed_documents_apart(model: nn.Module) -> None:
    """Make flash_attention_2 keep the documents of packed rows apart, for any number of rows (`model`: an HF
    causal LM, not yet LoRA-wrapped, as `build_meta_model` has it).

    A forward pre-hook on the HF base model (e.g. `LlamaModel`) turns restarting `position_ids` into the
    cumulative document lengths that transformers hands to flash-attn's varlen kernel (`cu_seq_lens_q/k`).
    Calls with a padding mask or a KV cache (generation) are left alone.
    """
    base = getattr(model, "base_model", model)
    base.register_forward_pre_hook(_add_document_lengths, with_kwargs=True)


@dataclass
class _Documents:
    """A batch's document starts (`cu_seq_lens` over its rows laid end to end), found by the loader."""

    position_ids: torch.Tensor  # the batch's, as the model gets them: a micro-batch is a slice of its rows
    on_host: np.ndarray
    on_device: torch.Tensor


_batch: _Documents | None = None


def use_documents(position_ids: torch.Tensor, cu_seq_lens: torch.Tensor, on_device: torch.Tensor) -> None:
    """Hand flash-attn the documents of the batch whose `position_ids` (on the device) the next forwards get, or
    slices of whose rows (micro-batches) they get.

    Args:
        position_ids: the batch's position ids, on the device.
        cu_seq_lens: the batch's document starts on the host, as the loader found them
            (`clustertrain.data.pack.document_bounds`).
        on_device: the same, copied to the device.
    """
    global _batch
    _batch = _Documents(position_ids, cu_seq_lens.numpy(), on_device)


def document_lengths(position_ids: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """flash-attn varlen arguments for rows of packed documents: a document starts at each row's start and
    wherever a position does not follow the one before it (as `masking_utils.find_packed_sequence_indices`).

    The cumulative lengths index the rows laid end to end. The row length serves as the longest document:
    flash-attn only needs an upper bound, and this one costs no read from the GPU. The starts come from the
    loader when `position_ids` are (rows of) the batch given to `use_documents`; otherwise they are found on the
    device, which costs a read from the GPU per forward, as transformers' own derivation for a single row does.
    """
    rows, length = position_ids.shape
    cumulative = _from_the_loader(position_ids)
    if cumulative is None:
        starts = torch.ones_like(position_ids, dtype=torch.bool)
        starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
        ends = torch.tensor([rows * length], device=position_ids.device)
        cumulative = torch.cat([starts.flatten().nonzero().flatten(), ends]).to(torch.int32)
    return {"cu_seq_lens_q": cumulative, "cu_seq_lens_k": cumulative, "max_length_q": length, "max_length_k": length}


def _from_the_loader(position_ids: torch.Tensor) -> torch.Tensor | None:
    """The document starts of `position_ids` from the batch given to `use_documents`, if they are rows of it:
    the rows' share of its starts, from where the rows begin in its memory (a view shares it)."""
    batch = _batch
    if batch is None:
        return None
    whole = batch.position_ids
    row_bytes = whole.stride(0) * whole.element_size()
    offset = position_ids.data_ptr() - whole.data_ptr()
    if (position_ids.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
            or position_ids.dtype != whole.dtype or position_ids.stride() != whole.stride()
            or position_ids.shape[1] != whole.shape[1] or offset % row_bytes):
        return None
    length = whole.shape[1]
    first = offset // row_bytes
    last = first + position_ids.shape[0]
    if not 0 <= first < last <= whole.shape[0]:
        return None
    # every row starts a document, so the rows' starts run from the one at the first row's start to the last's end
    i, j = np.searchsorted(batch.on_host, [first * length, last * length])
    cumulative = batch.on_device[i : j + 1]
    return cumulative - first * length if first else cumulative


def _add_document_lengths(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    positions = kwargs.get("position_ids")
    if (positions is None or positions.ndim != 2 or args or kwargs.get("attention_mask") is not None
            or kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None
            or "cu_seq_lens_q" in kwargs):
        return None
    inputs = kwargs.get("input_ids")
    rows = (inputs if inputs is not None else kwargs["inputs_embeds"]).shape[0]
    return args, {**kwargs, **document_lengths(positions.expand(rows, -1))}


def _supported(hf_config: PretrainedConfig) -> set[str]:
    """The kernels transformers implements for this family (all of them when the class is unknown)."""
    try:
        cls = AutoModelForCausalLM._model_mapping[type(hf_config)]
    except (KeyError, AttributeError):
        return {"sdpa", "eager", "flash_attention_2", "flex_attention"}
    flags = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
             "flex_attention": "_supports_flex_attn"}
    return {"eager"} | {name for name, flag in flags.items() if getattr(cls, flag, False)}


def _flash_attn_problem() -> str | None:
    """Why flash_attention_2 cannot run here, or None: the package must be installed, import, and see a GPU."""
    from transformers.utils import is_flash_attn_2_available

    if importlib.util.find_spec("flash_attn") is None:
        return ("needs the flash-attn package (pip install flash-attn --no-build-isolation; ROCm: "
                "ROCm/flash-attention), which is not installed")
    try:
        importlib.import_module("flash_attn")
    except (ImportError, OSError) as e:
        return f"needs flash-attn, which is installed but does not import ({e})"
    if not is_flash_attn_2_available():
        return "needs flash-attn >= 2.3.3 and a GPU that torch can see"
    return None


def _flex_attention_trains_on_cpu() -> bool:
    """Whether the installed torch has a FlexAttention backward on CPU (none up to at least 2.13)."""
    from torch.nn.attention import flex_attention

    check = getattr(flex_attention, "_validate_device", None)
    if check is None:
        return True  # the check is gone: torch itself will say if something is missing
    probe = torch.zeros(1, 1, 1, 8, requires_grad=True)
    try:
        check(probe, probe, probe)
    except NotImplementedError:
        return False
    return True


_rows_packed: ContextVar[bool | None] = ContextVar("clustertrain_rows_packed", default=None)


@contextlib.contextmanager
def rows_packed(packed: bool) -> Iterator[None]:
    """Tell transformers whether the rows of the forwards within hold several documents each (their position ids
    restart inside a row), so that it need not ask the GPU.

    Given position ids and no padding mask, transformers' mask creation (`find_packed_sequence_indices`) reads one
    flag from the GPU at every forward to learn whether rows are packed; the caller knows, from the batch it
    built. Outside this context (generation, other callers) transformers decides as before.
    """
    _answer_packed_rows_from_context()
    token = _rows_packed.set(packed)
    try:
        yield
    finally:
        _rows_packed.reset(token)


@functools.cache
def _answer_packed_rows_from_context() -> None:
    from transformers import masking_utils

    asks_the_gpu = getattr(masking_utils, "find_packed_sequence_indices", None)
    if asks_the_gpu is None:  # a transformers that does not look for packed rows
        return

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        packed = _rows_packed.get()
        if packed is None:
            return asks_the_gpu(position_ids)
        if not packed:
            return None  # what transformers finds for rows of one document: a plain causal mask
        # transformers' own rule, without its check whether any row holds more than one document
        restarts = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1
        return restarts.cumsum(-1)

    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
