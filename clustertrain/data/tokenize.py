"""Tokenizers (a local HF directory, or a byte-level BPE trained here and cached) and cached token arrays."""

from __future__ import annotations

import hashlib
import shutil
import json
import os
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from clustertrain.config.schema import DataConfig
from clustertrain.data.sources import read_documents
from clustertrain.errors import DataError

EOS = "<|endoftext|>"


def cache_root(data: DataConfig) -> Path:
    """The cache directory for tokenizers and token arrays."""
    default = os.environ.get("CLUSTERTRAIN_CACHE", "~/.cache/clustertrain")
    return Path(data.cache_dir or default).expanduser()


def sources_key(data: DataConfig) -> str:
    """A short hash naming what the sources are, for cache paths."""
    spec = json.dumps([s.model_dump() for s in data.sources], sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


def tokenizer_dir(data: DataConfig) -> Path:
    """Where the tokenizer lives: the configured directory, or this config's cached trained one."""
    if data.tokenizer:
        return Path(data.tokenizer).expanduser()
    return cache_root(data) / "tokenizers" / f"bpe{data.vocab_size}-{sources_key(data)}"


def load_tokenizer(data: DataConfig) -> PreTrainedTokenizerBase:
    """Load the tokenizer of `data`, training and caching a byte-level BPE first when none is configured."""
    path = tokenizer_dir(data)
    if not data.tokenizer and not (path / "tokenizer.json").exists():
        train_bpe(data, path)
    if not path.is_dir():
        raise DataError(f"data.tokenizer: {path} is not a tokenizer directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
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
    tokenizer.train_from_iterator((doc for s in data.sources for doc in read_documents(s)), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    fast.save_pretrained(tmp)
    _publish(tmp, out_dir)


def token_cache_path(data: DataConfig, tokenizer: PreTrainedTokenizerBase) -> Path:
    """The cached token array for these sources and this tokenizer."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items())).encode()
    key = hashlib.sha256(vocab + sources_key(data).encode()).hexdigest()[:16]
    return cache_root(data) / "tokens" / f"{key}.npy"


def tokenize_sources(data: DataConfig, tokenizer: PreTrainedTokenizerBase) -> np.ndarray:
    """All documents of all sources, tokenized and joined with EOS; cached on disk and memory-mapped."""
    path = token_cache_path(data, tokenizer)
    if not path.exists():
        ids: list[int] = []
        docs = [doc for s in data.sources for doc in read_documents(s)]
        for encoded in tokenizer(docs, add_special_tokens=False)["input_ids"]:
            ids.extend(encoded)
            ids.append(tokenizer.eos_token_id)
        dtype = np.uint16 if len(tokenizer) <= 2**16 else np.uint32
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.tmp-{os.getpid()}.npy")
        np.save(tmp, np.asarray(ids, dtype=dtype))
        os.replace(tmp, path)
    return np.load(path, mmap_mode="r")


def _publish(tmp: Path, final: Path) -> None:
    """Move a finished directory into place; a concurrent builder that won the race keeps its copy."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
