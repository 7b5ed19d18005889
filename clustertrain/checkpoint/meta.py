"""Meta's original Llama checkpoints in and out: `consolidated.*.pth` shards, `params.json`, the tiktoken
`tokenizer.model`.

    clustertrain import /scratch/Llama-3.1-8B/original models/llama-3.1-8b    # -> a Hugging Face Llama snapshot
    clustertrain export --format meta runs/llama-cpt exports/llama-cpt-pth    # -> consolidated.00.pth, params.json

Meta's attention rotates interleaved pairs of each head's query and key features (2i, 2i+1); transformers' Llama
rotates the first half of a head against its second. The two are the same model once the rows of `wq` and `wk` are
permuted within each head, which `to_hf_rotary` and `to_meta_rotary` do. Model-parallel shards split each weight
along the dimension its layer is parallel in (output rows, or input columns for `wo`, `w2`); norms are replicated.
`.pth` files are read with `torch.load(weights_only=True, mmap=True)` only: tensors and plain data, never code.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig

from clustertrain.checkpoint.compat import legacy_config_keys
from clustertrain.errors import CheckpointError, first_line
from clustertrain.model.weights import read_pth

PARAMS = "params.json"
TOKENIZER_MODEL = "tokenizer.model"
SHARDS = "consolidated.*.pth"
# Meta's names inside a layer and at the top, and transformers' Llama names for them.
_LAYER_NAMES = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
                "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
                "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
                "feed_forward.w3": "mlp.up_proj",
                "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_MODEL_NAMES = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
_ROW_PARALLEL = {"attention.wo", "feed_forward.w2"}  # split along their input columns; the rest along output rows
_REQUIRED = {"dim": int, "n_layers": int, "n_heads": int, "vocab_size": int, "multiple_of": int, "norm_eps": float,
             "rope_theta": float}
_OPTIONAL = {"n_kv_heads": int, "ffn_dim_multiplier": float, "use_scaled_rope": bool, "rope_scaling_factor": float}
_KINDS = {int: "a whole number", float: "a number", bool: "true or false"}
_SCALED_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}  # Llama 3.1's, fixed by Meta's reference code


@dataclass(frozen=True)
class MetaParams:
    """params.json: the shape of a Meta Llama. `rope_scaling_factor` is 8 unless given (Llama 3.2 1B/3B: 32)."""

    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    multiple_of: int
    norm_eps: float
    rope_theta: float
    n_kv_heads: int | None = None
    ffn_dim_multiplier: float | None = None
    use_scaled_rope: bool = False
    rope_scaling_factor: float | None = None

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        """The feed-forward width, as Meta's reference model computes it from `dim`."""
        return ffn_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a consolidated checkpoint of this shape holds, by Meta's name, in order."""
        head = self.dim // self.n_heads
        q, kv, d, f = self.n_heads * head, self.kv_heads * head, self.dim, self.ffn_dim
        out: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (self.vocab_size, d)}
        for i in range(self.n_layers):
            layer = {"attention.wq": (q, d), "attention.wk": (kv, d), "attention.wv": (kv, d), "attention.wo": (d, q),
                     "feed_forward.w1": (f, d), "feed_forward.w2": (d, f), "feed_forward.w3": (f, d),
                     "attention_norm": (d,), "ffn_norm": (d,)}
            out.update({f"layers.{i}.{name}.weight": shape for name, shape in layer.items()})
        return {**out, "norm.weight": (d,), "output.weight": (self.vocab_size, d)}

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None}, indent=2) + "\n"


def ffn_dim(dim: int, multiple_of: int, multiplier: float | None) -> int:
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def read_params(file: Path) -> MetaParams:
    """A params.json, checked: one line naming the file and the first key that is missing or of the wrong type."""
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{file.parent} has no {PARAMS}, so it is not a Meta Llama checkpoint folder") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file} is not JSON ({first_line(e)})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file} is not a JSON object of Meta's model parameters")
    for key, kind in _REQUIRED.items():
        if key not in raw:
            raise CheckpointError(f"{file} has no {key!r}; Meta's params.json gives {', '.join(_REQUIRED)}")
        if not isinstance(raw[key], (int, kind)) or isinstance(raw[key], bool) or raw[key] <= 0:
            raise CheckpointError(f"{file}: {key} = {raw[key]!r} is not {_KINDS[kind]} above 0")
    for key, kind in _OPTIONAL.items():
        value = raw.get(key)
        if value is not None and not (isinstance(value, kind) or kind is float and isinstance(value, int)):
            raise CheckpointError(f"{file}: {key} = {value!r} is not {_KINDS[kind]}")
    known = {k: raw[k] for k in MetaParams.__dataclass_fields__ if k in raw}
    params = MetaParams(**known)
    if params.dim % params.n_heads or params.n_heads % params.kv_heads:
        raise CheckpointError(f"{file}: dim {params.dim}, n_heads {params.n_heads} and n_kv_heads {params.kv_heads} "
                              "do not divide into whole heads")
    return params


def read_consolidated(folder: Path, params: MetaParams) -> dict[str, torch.Tensor]:
    """The whole model of `folder`'s consolidated shards by Meta's name, checked against `params` (one line on the
    first tensor that is missing, unexpected or of another shape). An absent `output.weight` means it is tied."""
    files = sorted(folder.glob(SHARDS))
    if not files:
        raise CheckpointError(f"{folder} has {PARAMS} but no consolidated.NN.pth weight shards")
    shards = [read_pth(file) for file in files]
    for file, shard in zip(files[1:], shards[1:]):
        if shard.keys() != shards[0].keys():
            odd = sorted(shard.keys() ^ shards[0].keys())[0]
            raise CheckpointError(f"{file} and {files[0].name} disagree: only one of them holds {odd}")
    state = {name: merge_shards(name, [s[name] for s in shards], params.dim, folder)
             for name in shards[0] if not name.startswith("rope.")}  # rope.freqs: recomputed, not a weight
    check_shapes(state, params, folder)
    return state


def merge_shards(name: str, parts: list[torch.Tensor], dim: int, where: Path) -> torch.Tensor:
    """One weight from its model-parallel pieces, concatenated along the dimension they were split in."""
    if len(parts) == 1 or parts[0].ndim == 1:
        return parts[0]  # norms are replicated
    stem = re.sub(r"^layers\.\d+\.|\.weight$", "", name)
    split = 1 if stem in _ROW_PARALLEL or (stem == "tok_embeddings" and parts[0].shape[1] != dim) else 0
    try:
        return torch.cat(parts, dim=split)
    except RuntimeError:
        shapes = ", ".join(str(tuple(part.shape)) for part in parts)
        raise CheckpointError(f"{where}: the shards' pieces of {name} do not fit together ({shapes})") from None


def check_shapes(state: dict[str, torch.Tensor], params: MetaParams, where: Path) -> None:
    expected = params.shapes()
    if "output.weight" not in state:
        expected.pop("output.weight")
    for name, shape in expected.items():
        if name not in state:
            raise CheckpointError(f"{where}: no {name}, which {PARAMS} says a model of {params.n_layers} layers has")
        if tuple(state[name].shape) != shape:
            raise CheckpointError(f"{where}: {name} is {tuple(state[name].shape)} but {PARAMS} gives {shape}; the "
                                  "shards and params.json disagree")
    if extra := sorted(state.keys() - expected.keys()):
        raise CheckpointError(f"{where}: {extra[0]} is not a weight of the Llama {PARAMS} describes")


def to_hf_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """`wq`/`wk` rows from Meta's interleaved rotary pairs to transformers' halves, head by head."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def to_meta_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `to_hf_rotary`."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_weights(state: dict[str, torch.Tensor], params: MetaParams) -> dict[str, torch.Tensor]:
    """Meta-named weights as transformers' Llama state dict (lm_head left out when `output.weight` is absent)."""
    out = {}
    for name, tensor in state.items():
        stem, _, leaf = name.rpartition(".")
        layer, _, inner = stem.partition(".")[2].partition(".") if stem.startswith("layers.") else ("", "", "")
        if stem in _MODEL_NAMES:
            out[f"{_MODEL_NAMES[stem]}.{leaf}"] = tensor
            continue
        if inner == "attention.wq":
            tensor = to_hf_rotary(tensor, params.n_heads)
        elif inner == "attention.wk":
            tensor = to_hf_rotary(tensor, params.kv_heads)
        out[f"model.layers.{layer}.{_LAYER_NAMES[inner]}.{leaf}"] = tensor
    return out


def meta_weights(state: dict[str, torch.Tensor], params: MetaParams) -> dict[str, torch.Tensor]:
    """transformers' Llama weights by Meta's names, in Meta's order (`output.weight` written even when tied)."""
    names = {f"{hf}.weight": f"{meta}.weight" for meta, hf in _MODEL_NAMES.items()}
    for i in range(params.n_layers):
        names.update({f"model.layers.{i}.{hf}.weight": f"layers.{i}.{meta}.weight"
                      for meta, hf in _LAYER_NAMES.items()})
    found = {names[name]: tensor for name, tensor in state.items() if name in names}
    found.setdefault("output.weight", found["tok_embeddings.weight"])
    for i in range(params.n_layers):
        found[f"layers.{i}.attention.wq.weight"] = to_meta_rotary(found[f"layers.{i}.attention.wq.weight"],
                                                                  params.n_heads)
        found[f"layers.{i}.attention.wk.weight"] = to_meta_rotary(found[f"layers.{i}.attention.wk.weight"],
                                                                  params.kv_heads)
    return {name: found[name].contiguous() for name in params.shapes()}


def llama_config(params: MetaParams, tied: bool, bos: int | None, eos: int | None, dtype: torch.dtype) -> LlamaConfig:
    """transformers' LlamaConfig of the model `params` describes (Llama 3.1's long context when its rope is scaled)."""
    scaling = {**_SCALED_ROPE, "factor": params.rope_scaling_factor or 8.0} if params.use_scaled_rope else None
    return LlamaConfig(
        vocab_size=params.vocab_size, hidden_size=params.dim, intermediate_size=params.ffn_dim,
        num_hidden_layers=params.n_layers, num_attention_heads=params.n_heads, num_key_value_heads=params.kv_heads,
        rms_norm_eps=params.norm_eps, rope_theta=float(params.rope_theta), rope_scaling=scaling,
        max_position_embeddings=131072 if params.use_scaled_rope else 8192, tie_word_embeddings=tied,
        bos_token_id=bos, eos_token_id=eos, architectures=["LlamaForCausalLM"], dtype=dtype,
    )


def params_of(config: Any, where: Path) -> MetaParams:
    """The params.json of a transformers Llama config; one line for a model Meta's format cannot hold."""
    fields = legacy_config_keys(config.to_dict())  # rope_theta and rope_scaling under 4.x's names, whichever wrote it
    head_dim = fields.get("head_dim") or config.hidden_size // config.num_attention_heads
    scaling = fields.get("rope_scaling") or {}
    if config.model_type != "llama" or head_dim * config.num_attention_heads != config.hidden_size \
            or fields.get("attention_bias") or fields.get("mlp_bias") or fields.get("hidden_act", "silu") != "silu" \
            or scaling.get("rope_type", "llama3") != "llama3":
        raise CheckpointError(f"{where}: Meta's format holds Llama models only (a {config.model_type} with these "
                              "settings cannot be written as consolidated.00.pth); export it in the default format")
    multiple_of, multiplier = _ffn_factors(config.hidden_size, config.intermediate_size)
    factor = scaling.get("factor", 8.0)
    return MetaParams(
        dim=config.hidden_size, n_layers=config.num_hidden_layers, n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads, vocab_size=config.vocab_size, multiple_of=multiple_of,
        ffn_dim_multiplier=multiplier, norm_eps=config.rms_norm_eps, rope_theta=fields.get("rope_theta", 10000.0),
        use_scaled_rope=bool(scaling), rope_scaling_factor=factor if scaling and factor != 8.0 else None,
    )


def _ffn_factors(dim: int, intermediate: int) -> tuple[int, float | None]:
    """A (multiple_of, ffn_dim_multiplier) that gives `intermediate` by Meta's formula: the values Meta's Llama 3
    releases use where one fits, else the width itself as the multiple (exact for any width at least 8/3 dim)."""
    for multiplier in (None, 1.3, 1.5, 1.2, 1.0):
        for multiple_of in (256, 1024, 4096):
            if ffn_dim(dim, multiple_of, multiplier) == intermediate:
                return multiple_of, multiplier
    if ffn_dim(dim, intermediate, None) == intermediate:
        return intermediate, None
    return intermediate, intermediate / int(8 * dim / 3) + 1e-9  # narrower than 8/3 dim: scale it down


def find_tokenizer(source: Path | None, folder: Path, llama31: bool) -> Any:
    """The tokenizer to import: `source` (a tiktoken file, or a Hugging Face tokenizer folder), else `folder`'s
    tokenizer.model, else None."""
    from transformers import AutoTokenizer

    from clustertrain.checkpoint.meta_tokenizer import tokenizer_from_tiktoken

    if source is None:
        source = folder / TOKENIZER_MODEL if (folder / TOKENIZER_MODEL).is_file() else None
    if source is None:
        return None
    if source.is_file():
        return tokenizer_from_tiktoken(source, llama31)
    if not source.is_dir():
        raise CheckpointError(f"--tokenizer {source} does not exist")
    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"--tokenizer {source}: not a Hugging Face tokenizer folder ({first_line(e)})") from None


def write_snapshot(state: dict[str, torch.Tensor], params: MetaParams, tokenizer: Any, folder: Path,
                   where: Path) -> None:
    """Meta-named weights, their params and tokenizer as a Hugging Face Llama snapshot in `folder`, in the
    weights' own dtype: config.json (with transformers 4's keys), safetensors shards, the tokenizer."""
    from huggingface_hub import save_torch_state_dict
    from transformers import GenerationConfig

    from clustertrain.checkpoint.compat import write_legacy_config, write_portable_tokenizer_class

    check_shapes(state, params, where)
    if tokenizer is not None and len(tokenizer) > params.vocab_size:
        raise CheckpointError(f"{where}: the tokenizer has {len(tokenizer)} tokens but {PARAMS} only "
                              f"vocab_size {params.vocab_size}; pass the tokenizer the model was trained with")
    bos = tokenizer.bos_token_id if tokenizer is not None else None
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    dtype = state["tok_embeddings.weight"].dtype
    config = llama_config(params, "output.weight" not in state, bos, eos, dtype)
    save_torch_state_dict(hf_weights(state, params), folder, max_shard_size="5GB")
    config.save_pretrained(folder)
    write_legacy_config(folder)
    GenerationConfig.from_model_config(config).save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
        write_portable_tokenizer_class(folder)


def import_meta(meta_dir: str | Path, out_dir: str | Path, tokenizer: str | Path | None = None) -> Path:
    """Write Meta's original checkpoint folder (`consolidated.*.pth`, `params.json`, `tokenizer.model`) as a
    Hugging Face Llama snapshot: `model.path` of a run, or `clustertrain import` it again for a checkpoint.

    Args:
        tokenizer: a tiktoken file or a Hugging Face tokenizer folder to use instead of the folder's tokenizer.model.
    """
    from clustertrain.checkpoint.export import publish_folder, refuse_non_empty

    meta_dir, out_dir = Path(meta_dir), Path(out_dir)
    params = read_params(meta_dir / PARAMS)
    refuse_non_empty(out_dir)
    state = read_consolidated(meta_dir, params)
    found = find_tokenizer(Path(tokenizer) if tokenizer else None, meta_dir, params.use_scaled_rope)
    publish_folder(out_dir, lambda folder: write_snapshot(state, params, found, folder, meta_dir))
    return out_dir


def write_meta_files(hf_dir: Path, folder: Path, dtype: torch.dtype | None = None) -> None:
    """A Hugging Face Llama snapshot as Meta's files in `folder`: consolidated.00.pth (in `dtype`, default as
    stored), params.json, and the tokenizer.model when its tokenizer is a Llama 3 tiktoken one."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from clustertrain.checkpoint.meta_tokenizer import write_tiktoken

    config = AutoConfig.from_pretrained(hf_dir, local_files_only=True, trust_remote_code=False)
    params = params_of(config, hf_dir)
    state = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(file))
    if not state:
        raise CheckpointError(f"{hf_dir} has no safetensors weights to write in Meta's format")
    weights = meta_weights(state, params)
    torch.save({k: v.to(dtype or v.dtype) for k, v in weights.items()}, folder / "consolidated.00.pth")
    (folder / PARAMS).write_text(params.to_json())
    if (hf_dir / "tokenizer.json").is_file():
        write_tiktoken(AutoTokenizer.from_pretrained(hf_dir, local_files_only=True), folder / TOKENIZER_MODEL)


def export_meta(source: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None,
                merge: bool = False) -> Path:
    """Write a checkpoint (a `step-N/` folder or a run's newest) or a Hugging Face Llama snapshot in Meta's format.

    A checkpoint goes through a Hugging Face export into a hidden folder first (in `dtype`, default the run's),
    so LoRA runs need `merge`: Meta's format holds whole models only.
    """
    from clustertrain.checkpoint.export import publish_folder, refuse_checkpoints_folder, refuse_non_empty, export_hf

    source, out_dir = Path(source), Path(out_dir)
    refuse_non_empty(out_dir)
    refuse_checkpoints_folder(out_dir)

    def write(folder: Path) -> None:
        hf_dir = source
        if not (source / "config.json").is_file():
            hf_dir = export_hf(source, folder / "hf", dtype=dtype, merge=merge)
            if (hf_dir / "adapter_config.json").is_file():
                raise CheckpointError(f"{source} is a LoRA run and Meta's format holds whole models: add --merge")
        write_meta_files(hf_dir, folder, dtype)
        if hf_dir != source:
            shutil.rmtree(hf_dir)

    publish_folder(out_dir, write)
    return out_dir
