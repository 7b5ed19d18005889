"""Tokenizers: a local HF directory, or a byte-level BPE trained here on the configured sources and cached."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from clustertrain.config.data_schema import DataConfig
from clustertrain.config.remote_code import custom_code
from clustertrain.data.plan import text_pieces
from clustertrain.data.readers import check_text
from clustertrain.data.sources import open_source, text_of
from clustertrain.data.tokens import is_token_source
from clustertrain.errors import DataError, first_line
from clustertrain.files import json_type

EOS = "<|endoftext|>"


def cache_root(data: DataConfig) -> Path:
    """The cache directory for tokenizers and token arrays."""
    default = os.environ.get("CLUSTERTRAIN_CACHE", "~/.cache/clustertrain")
    return Path(data.cache_dir or default).expanduser()


def sources_key(data: DataConfig) -> str:
    """A short hash naming what the sources are, for the tokenizer's cache path."""
    spec = json.dumps([s.model_dump() for s in data.sources], sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


def tokenizer_dir(data: DataConfig) -> Path:
    """Where the tokenizer lives: the configured directory, or this config's cached trained one."""
    if data.tokenizer:
        return Path(data.tokenizer).expanduser()
    return cache_root(data) / "tokenizers" / f"bpe{data.vocab_size}-{sources_key(data)}"


def load_tokenizer(data: DataConfig) -> PreTrainedTokenizerBase | None:
    """Load the tokenizer of `data`, training and caching a byte-level BPE first when none is configured.

    Random-token data needs none (None is returned unless one is configured).
    """
    if data.mode == "random" and not data.tokenizer:
        return None
    path = tokenizer_dir(data)
    if not data.tokenizer and not (path / "tokenizer.json").exists():
        train_bpe(data, path)
    if not path.is_dir():
        raise DataError(f"data.tokenizer: {path} is not a tokenizer directory")
    if problem := custom_code(path):
        raise DataError(f"data.tokenizer: {problem}")
    try:
        tokenizer = open_tokenizer(path)
    except Exception as e:  # noqa: BLE001 - on a garbage file transformers raises KeyError, AttributeError, ...
        problem = tokenizer_files_problem(path) or f"cannot load a tokenizer from {path}: {first_line(e)}"
        raise DataError(f"data.tokenizer: {problem}") from None
    if tokenizer.eos_token_id is None:
        raise DataError(f"data.tokenizer: {path} defines no eos_token, which packing needs between documents")
    return tokenizer


def open_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in `folder`, read alike under transformers 4.57 and 5.x, whichever of them wrote it."""
    if names_a_v5_only_class(folder):
        return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)


# transformers 5 saves a tokenizers-library tokenizer under the class name `TokenizersBackend` (or none), which 4.x
# lacks ("Tokenizer class TokenizersBackend does not exist"); `PreTrainedTokenizerFast`, which every release has (in
# 5 the same class), reads the same tokenizer.json.
PORTABLE_TOKENIZER = "PreTrainedTokenizerFast"


def names_a_v5_only_class(folder: Path) -> bool:
    """Whether `folder` holds a fast tokenizer whose tokenizer_config.json names a class only transformers 5 has."""
    file = folder / "tokenizer_config.json"
    if not file.is_file() or not (folder / "tokenizer.json").is_file():
        return False  # a slow (sentencepiece) tokenizer keeps its own class
    try:
        config = json.loads(file.read_text())
    except ValueError:
        return False  # AutoTokenizer fails on it, and tokenizer_files_problem says why
    return isinstance(config, dict) and config.get("tokenizer_class") in (None, "TokenizersBackend")


# The files of a tokenizer transformers can load: a fast tokenizer's tokenizer.json, or a slow one's vocabulary.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "tekken.json")


def tokenizer_files_problem(path: Path) -> str | None:
    """Why the folder `path` holds no tokenizer transformers could load, or None: none of TOKENIZER_FILES, a
    tokenizer.json the tokenizers library cannot read (or without the list transformers reads), a config file that
    is not a JSON object."""
    from tokenizers import Tokenizer

    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return (f"{path} holds no tokenizer: expected tokenizer.json (as save_pretrained writes it), or a slow "
                "tokenizer's tokenizer.model or vocab.json with merges.txt")
    file = path / "tokenizer.json"
    if file.is_file():
        try:
            Tokenizer.from_file(str(file))
            value = json.loads(file.read_bytes())
        except Exception as e:  # noqa: BLE001 - the Rust library raises a bare Exception
            return (f"{file} is not a tokenizer the tokenizers library reads ({first_line(e)}); write it with "
                    "save_pretrained")
        if not isinstance(value.get("added_tokens"), list):  # the library defaults it, transformers needs it
            return f"{file} has no \"added_tokens\" list, which transformers reads; write it with save_pretrained"
    for file in (path / "tokenizer_config.json", path / "special_tokens_map.json"):
        try:
            value = json.loads(file.read_bytes())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            return f"{file} is not JSON ({first_line(e)}); write it with save_pretrained"
        if not isinstance(value, dict):
            return f"{file} holds a JSON {json_type(value)}, not an object; write it with save_pretrained"
    return None


def train_bpe(data: DataConfig, out_dir: Path) -> None:
    """Train a byte-level BPE on the configured sources and save it as an HF tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=data.vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_texts(data), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    fast.save_pretrained(tmp)
    _publish(tmp, out_dir)


def training_texts(data: DataConfig) -> Iterator[str]:
    """Every text of the configured sources (the text field, or all string fields of SFT records)."""
    for config in data.sources:
        if is_token_source(config):
            continue
        source = open_source(config, on_bad_data="skip", cache_dir=cache_root(data))
        field = "text" if source.format in ("text", "stdlib") else config.field
        for doc in source.read(0, len(source)):
            if data.mode == "sft":
                yield from _strings(doc.record)
            else:
                try:
                    yield from text_pieces(text_of(doc, field))  # a long document in pieces: bounded memory
                except DataError:
                    continue


def _strings(value) -> Iterator[str]:
    if isinstance(value, str):
        try:
            text = check_text(value, "a string")
        except DataError:  # a lone surrogate, which the BPE trainer cannot take: refused when the record is read
            return
        yield from text_pieces(text)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _publish(tmp: Path, final: Path) -> None:
    """Move a finished directory into place; a concurrent builder that won the race keeps its copy."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
