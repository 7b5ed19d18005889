"""Meta's tiktoken `tokenizer.model` <-> a transformers fast tokenizer, both ways, without the network.

A tiktoken file is one line per token: its bytes in base64 and its rank, which is its id. Llama 3 adds 256 special
tokens after the last rank (`<|begin_of_text|>` first). tiktoken merges the pair of a piece whose merge has the
lowest rank; a byte-level BPE whose merges are every split of each token into two tokens, in rank order, encodes
the same (the construction of transformers' TikTokenConverter). It is built here rather than by that converter,
which needs the tiktoken package in transformers 4 and reads files through tiktoken's loader, whose cache is keyed
by path: a changed file at the same path would be read stale.
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from clustertrain.errors import CheckpointError

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# How Llama 3 splits text into pieces before BPE (its tokenizer's pat_str).
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")
_RESERVED = 256  # special tokens after the ranks, in every Llama 3 release
# Llama 3.1 and later (its rope is scaled) name some reserved tokens; Llama 3 named fewer.
_NAMED_31 = [BOS, EOS, "<|reserved_special_token_0|>", "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
             "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
_NAMED_3 = [BOS, EOS, *(f"<|reserved_special_token_{i}|>" for i in range(4)), "<|start_header_id|>",
            "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]


def special_tokens(llama31: bool) -> list[str]:
    """The 256 special tokens of Llama 3.1+ (`llama31`) or Llama 3, in id order after the ranks."""
    named = _NAMED_31 if llama31 else _NAMED_3
    first = 2 if llama31 else 5
    return named + [f"<|reserved_special_token_{first + i}|>" for i in range(_RESERVED - len(named))]


def read_ranks(file: Path) -> dict[bytes, int]:
    """A tiktoken file's ranks; one line naming the file and line if it is not one."""
    ranks: dict[bytes, int] = {}
    try:
        lines = file.read_bytes().splitlines()
    except OSError as e:
        raise CheckpointError(f"cannot read {file}: {e.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise CheckpointError(f"{file}:{number} is not a tiktoken line (base64 token, rank); Meta's Llama 3 "
                                  "tokenizer.model is one; for another, pass --tokenizer with a Hugging Face "
                                  "tokenizer folder") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise CheckpointError(f"{file}: the ranks are not 0..{len(ranks) - 1} each once, so it is not a tiktoken BPE")
    return ranks


def byte_level_bpe(ranks: dict[bytes, int]) -> Tokenizer:
    """The BPE model that encodes as tiktoken does with `ranks`: each token's every split into two tokens is a
    merge, ordered by the merged token's rank, then by its halves' ranks."""
    chars = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(chars[byte] for byte in token)

    merges = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(text(a), text(b)) for a, b in sorted(splits, key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))]
    bpe = BPE({text(token): rank for token, rank in ranks.items()}, merges, fuse_unk=False)
    bpe.ignore_merges = True  # a piece that is a token is that token, as in tiktoken
    return Tokenizer(bpe)


def tokenizer_from_tiktoken(file: Path, llama31: bool) -> PreTrainedTokenizerFast:
    """A fast tokenizer that encodes as Meta's tokenizer.model does, starting each text with `<|begin_of_text|>`
    as transformers' Llama 3 tokenizers do."""
    backend = byte_level_bpe(read_ranks(file))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                for token in special_tokens(llama31)])
    bos_id = backend.token_to_id(BOS)
    backend.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
                                      special_tokens=[(BOS, bos_id)]),
    ])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS,
                                   model_max_length=131072 if llama31 else 8192)


def write_tiktoken(tokenizer: PreTrainedTokenizerFast, file: Path) -> bool:
    """Write `tokenizer` as a tiktoken file if it is one (a byte-level BPE whose first special token,
    `<|begin_of_text|>`, follows its last rank), as Meta's tokenizer.model lists it; False if it is not."""
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    if model.get("type") != "BPE" or tokenizer.convert_tokens_to_ids(BOS) != len(model["vocab"]):
        return False
    decode = {char: byte for byte, char in bytes_to_unicode().items()}
    by_rank = sorted(model["vocab"].items(), key=lambda item: item[1])
    if [rank for _, rank in by_rank] != list(range(len(by_rank))):
        return False
    try:
        lines = [base64.b64encode(bytes(decode[c] for c in token)) + b" %d" % rank for token, rank in by_rank]
    except KeyError:  # a character outside the byte-level alphabet: not a tiktoken vocabulary
        return False
    file.write_bytes(b"\n".join(lines) + b"\n")
    return True
