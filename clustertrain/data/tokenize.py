"""Tokenizers: a local HF directory, or a byte-level BPE trained here on the configured sources and cached."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from clustertrain.config.remote_code import custom_code
from clustertrain.config.schema import DataConfig
from clustertrain.data.plan import text_pieces
from clustertrain.data.readers import check_text
from clustertrain.data.sources import open_source, text_of
from clustertrain.data.tokens import is_token_source
from clustertrain.errors import DataError

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
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise DataError(f"data.tokenizer: cannot load a tokenizer from {path}: {str(e).splitlines()[0]}") from None
    if tokenizer.eos_token_id is None:
        raise DataError(f"data.tokenizer: {path} defines no eos_token, which packing needs between documents")
    return tokenizer


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
