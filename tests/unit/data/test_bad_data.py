"""Bad data, through the real `clustertrain train` in this process: exit 2, one `error:` line on stderr that names
the file (and line or row where there is one), no traceback, and the run directory exactly as it was.

Every case writes its files into a folder of its own and starts one rank with data.num_workers=0 and the tiny
model; the first global batch is read before the model is built, so each refusal costs well under a second.
"""

from __future__ import annotations

import gc
import io
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from helpers import TINY
from transformers import PreTrainedTokenizerFast

from clustertrain.cli import main

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

pytestmark = pytest.mark.timeout(60)  # a case that hangs (a loop over nothing but bad records) fails, not stalls

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CHAT_ROLES = "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}" \
             "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{% endfor %}"
GOOD = [{"text": f"def f{i}(x):\n    return x * {i} + {i % 7}  # the {i}th function"} for i in range(600)]
GOOD_SFT = [{"prompt": f"what is f{i}? ", "completion": r["text"]} for i, r in enumerate(GOOD)]
VOCAB = 320  # the tokenizer's size: token ids at or above it are out of vocabulary


def jsonl(*records) -> bytes:
    """Lines of a jsonl file: dicts as JSON, str and bytes as they are (the bad ones)."""
    return b"".join((r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps(r)).encode()) + b"\n"
                    for r in records)


def good_then(bad, at: int = 5, total: int = 12, good: list[dict] = GOOD) -> bytes:
    """`total` good records with `bad` at line `at`."""
    return jsonl(*good[: at - 1], bad, *good[at - 1 : total - 1])


def sft_then(bad) -> bytes:
    return good_then(bad, good=GOOD_SFT)


def npy(array, allow_pickle: bool = False) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(array), allow_pickle=allow_pickle)
    return buffer.getvalue()


def parquet(rows: list[dict] | None = None, table=None) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table if table is not None else pa.Table.from_pylist(rows), sink)
    return sink.getvalue().to_pybytes()


def arrow(rows: list[dict]) -> bytes:
    table = pa.Table.from_pylist(rows)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


GOOD_PARQUET = parquet(GOOD[:12])
GOOD_ARROW = arrow(GOOD[:12])
GOOD_NPY = npy(np.arange(2000, dtype=np.uint16) % VOCAB)
NPY_OBJECTS = npy(np.array([1, "os.system", None], dtype=object), allow_pickle=True)  # a pickle inside
GARBAGE = bytes(np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8))
CHAT = [{"role": "user", "content": "what is two and two"}, {"role": "assistant", "content": "four"}]
# A tokenizer.json the tokenizers library reads, but without the "added_tokens" list transformers needs; and with it.
WORDS = b'{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0, "<eos>": 1}, "unk_token": "a"}}'
WORDS_ADDED = WORDS.replace(b'"model"', b'"added_tokens": [], "model"')

# Each case: files written into its folder ({name: bytes}), changes to its source or the run, and a regular
# expression its error line must match; {d} stands for the folder in both. A change is `key: value` of the source,
# `SET key=value` of the run, `MODE`, `ON_BAD` (data.on_bad_data) or `SOURCES` (all of data.sources). A file named
# `@x` is a symbolic link to the path its content names, `|x` a FIFO.
CASES: dict[str, tuple[dict[str, bytes], list[str], str]] = {
    # -- jsonl: lines that are not JSON objects
    "jsonl unterminated string": ({"a.jsonl": good_then('{"text": "def f(')}, [],
                                  r"{d}/a\.jsonl:5: malformed JSON \(Invalid control character at column 17\)"),
    "jsonl bare word": ({"a.jsonl": good_then('{"text": oops}')}, [], r"{d}/a\.jsonl:5: malformed JSON"),
    "jsonl trailing comma": ({"a.jsonl": good_then('{"text": "x",}')}, [], r"{d}/a\.jsonl:5: malformed JSON"),
    "jsonl single quotes": ({"a.jsonl": good_then("{'text': 'x'}")}, [], r"{d}/a\.jsonl:5: malformed JSON"),
    "jsonl two objects on a line": ({"a.jsonl": good_then('{"text": "a"} {"text": "b"}')}, [],
                                    r"{d}/a\.jsonl:5: malformed JSON \(Extra data"),
    "jsonl pretty-printed object": ({"a.jsonl": jsonl("{", '  "text": "x"', "}", *GOOD[:8])}, [],
                                    r"{d}/a\.jsonl:1: malformed JSON"),
    "jsonl truncated last line": ({"a.jsonl": jsonl(*GOOD[:10])[:-20]}, [],
                                  r"{d}/a\.jsonl:10: malformed JSON \(Unterminated string starting at column 10\)"),
    "jsonl array line": ({"a.jsonl": good_then('["text", "x"]')}, [], r"{d}/a\.jsonl:5: not a JSON object \(got array"),
    "jsonl string line": ({"a.jsonl": good_then('"just text"')}, [], r"{d}/a\.jsonl:5: not a JSON object \(got string"),
    "jsonl number line": ({"a.jsonl": good_then("42")}, [], r"{d}/a\.jsonl:5: not a JSON object \(got number"),
    "jsonl null line": ({"a.jsonl": good_then("null")}, [], r"{d}/a\.jsonl:5: not a JSON object \(got null"),
    "jsonl deep nesting": ({"a.jsonl": good_then('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}")}, [],
                           r"{d}/a\.jsonl:5: malformed JSON \(nested too deeply"),
    "jsonl 5000-digit number": ({"a.jsonl": good_then('{"text": "x", "n": ' + "9" * 5000 + "}")}, [],
                                r"{d}/a\.jsonl:5: malformed JSON \(.*digits"),
    "jsonl bad line far down": ({"a.jsonl": good_then("{", at=500, total=600)}, [], r"{d}/a\.jsonl:500: malformed JSON"),
    # -- jsonl: objects without a usable text field
    "jsonl no text field": ({"a.jsonl": good_then({"content": "x"})}, [],
                            r"{d}/a\.jsonl:5: record has no field 'text' \(fields: content\)"),
    "jsonl empty object": ({"a.jsonl": good_then({})}, [], r"{d}/a\.jsonl:5: record has no field 'text'"),
    "jsonl text is a number": ({"a.jsonl": good_then({"text": 3.5})}, [],
                               r"{d}/a\.jsonl:5: field 'text' is number, not a string"),
    "jsonl text is null": ({"a.jsonl": good_then({"text": None})}, [], r"{d}/a\.jsonl:5: field 'text' is null"),
    "jsonl text is a list": ({"a.jsonl": good_then({"text": ["a", "b"]})}, [], r"{d}/a\.jsonl:5: field 'text' is array"),
    "jsonl text is an object": ({"a.jsonl": good_then({"text": {"body": "x"}})}, [],
                                r"{d}/a\.jsonl:5: field 'text' is object"),
    "jsonl text is a boolean": ({"a.jsonl": good_then({"text": True})}, [], r"{d}/a\.jsonl:5: field 'text' is boolean"),
    "jsonl field set to a missing one": ({"a.jsonl": jsonl(*GOOD[:12])}, ["field: content"],
                                         r"{d}/a\.jsonl:1: record has no field 'content' \(fields: text\)"),
    "jsonl lone surrogate": ({"a.jsonl": good_then('{"text": "half a pair \\ud800 here"}')}, [],
                             r"{d}/a\.jsonl:5: field 'text' holds a lone surrogate \\ud800 at character 12"),
    # -- encodings and bytes
    "jsonl latin-1 byte": ({"a.jsonl": good_then(b'{"text": "caf\xe9"}')}, [],
                           r"{d}/a\.jsonl:5: not UTF-8 \(byte 0xe9 at offset \d+\)"),
    "jsonl UTF-16 file": ({"a.jsonl": jsonl(*GOOD[:12]).decode().encode("utf-16")}, [], r"{d}/a\.jsonl:1: not UTF-8"),
    "jsonl binary garbage": ({"a.jsonl": GARBAGE}, [], r"{d}/a\.jsonl:\d+: (not UTF-8|malformed JSON)"),
    "jsonl NUL bytes": ({"a.jsonl": good_then(b"\x00" * 40)}, [],
                        r"{d}/a\.jsonl:5: binary data, not UTF-8 text \(a NUL byte at offset \d+\)"),
    "txt latin-1": ({"a.txt": "def café(): pass\n".encode("latin-1") * 50}, [], r"{d}/a\.txt: not UTF-8 \(byte 0xe9"),
    "txt binary garbage": ({"a.txt": GARBAGE}, [], r"{d}/a\.txt: not UTF-8"),
    "txt block with a bad byte": ({"a.txt": b"def f(): pass\n\nx = '\xff'\n\ny = 2\n" * 30}, ["text_unit: block"],
                                  r"{d}/a\.txt:3: not UTF-8 \(byte 0xff"),
    "json not UTF-8": ({"a.json": b'[{"text": "\xff"}]'}, [], r"{d}/a\.json: not UTF-8"),
    # -- empty files
    "jsonl empty file": ({"a.jsonl": b""}, [], r"{d}/a\.jsonl: empty file"),
    "jsonl only blank lines": ({"a.jsonl": b"\n  \n\t\n\n"}, [], r"{d}/a\.jsonl: empty file"),
    "txt empty file": ({"a.txt": b""}, [], r"{d}/a\.txt: empty file"),
    "txt only whitespace": ({"a.txt": b"   \n\n \t \n"}, [], r"{d}/a\.txt: empty file"),
    "json empty list": ({"a.json": b"[]"}, [], r"{d}/a\.json: empty file"),
    "json empty file": ({"a.json": b""}, [], r"{d}/a\.json: empty file"),
    "one of two files empty": ({"a.jsonl": jsonl(*GOOD[:12]), "b.jsonl": b""}, ["path: {d}/*.jsonl"],
                               r"{d}/b\.jsonl: empty file"),
    # -- .json files
    "json malformed": ({"a.json": b'[{"text": "x"},\n {"text": }]'}, [], r"{d}/a\.json:2: malformed JSON"),
    "json scalar": ({"a.json": b'"text"'}, [], r"{d}/a\.json: expected a list of records"),
    "json object of two lists": ({"a.json": json.dumps({"a": GOOD[:3], "b": GOOD[3:6]}).encode()}, [],
                                 r"{d}/a\.json: expected a list of records"),
    "json list with a number": ({"a.json": json.dumps([*GOOD[:4], 7, *GOOD[4:9]]).encode()}, [],
                                r"{d}/a\.json record 4: not a JSON object \(got number"),
    "json record without text": ({"a.json": json.dumps([*GOOD[:4], {"body": "x"}, *GOOD[4:9]]).encode()}, [],
                                 r"{d}/a\.json record 4: record has no field 'text'"),
    # -- Parquet and Arrow
    "parquet garbage": ({"a.parquet": GARBAGE}, [], r"{d}/a\.parquet: not a readable Parquet file"),
    "parquet truncated": ({"a.parquet": GOOD_PARQUET[: len(GOOD_PARQUET) // 2]}, [],
                          r"{d}/a\.parquet: not a readable Parquet file"),
    "parquet footer only": ({"a.parquet": GOOD_PARQUET[:4] + GOOD_PARQUET[-8:]}, [],
                            r"{d}/a\.parquet: not a readable Parquet file"),
    "parquet no text column": ({"a.parquet": parquet([{"body": r["text"]} for r in GOOD[:12]])}, [],
                               r"{d}/a\.parquet row 0: record has no field 'text' \(fields: body\)"),
    "parquet text column of ints": ({"a.parquet": parquet([{"text": i} for i in range(12)])}, [],
                                    r"{d}/a\.parquet row 0: field 'text' is number"),
    "parquet a null text": ({"a.parquet": parquet([*GOOD[:4], {"text": None}, *GOOD[4:12]])}, [],
                            r"{d}/a\.parquet row 4: field 'text' is null"),
    "parquet no rows": ({"a.parquet": parquet(table=pa.table({"text": pa.array([], pa.string())}))}, [],
                        r"{d}/a\.parquet: empty file"),
    "arrow garbage": ({"a.arrow": GARBAGE}, [], r"{d}/a\.arrow: not a readable Arrow file"),
    "arrow truncated": ({"a.arrow": GOOD_ARROW[: len(GOOD_ARROW) // 2]}, [], r"{d}/a\.arrow: not a readable Arrow file"),
    "arrow no text column": ({"a.arrow": arrow([{"body": r["text"]} for r in GOOD[:12]])}, [],
                             r"{d}/a\.arrow row 0: record has no field 'text'"),
    # -- token files
    "npy garbage": ({"a.npy": GARBAGE}, [], r"{d}/a\.npy: not a \.npy file \(no NumPy header\)"),
    "npy of Python objects": ({"a.npy": NPY_OBJECTS}, [],
                              r"{d}/a\.npy: cannot read token ids: Array can't be memory-mapped: Python objects"),
    "npy truncated": ({"a.npy": GOOD_NPY[:-1001]}, [], r"{d}/a\.npy: cannot read token ids"),
    "npy header only": ({"a.npy": GOOD_NPY[:128]}, [], r"{d}/a\.npy: cannot read token ids"),
    "npy 2-D": ({"a.npy": npy(np.zeros((40, 50), np.int32))}, [], r"{d}/a\.npy: expected a 1-D array of integer"),
    "npy floats": ({"a.npy": npy(np.zeros(2000, np.float32))}, [], r"{d}/a\.npy: expected a 1-D array of integer"),
    "npy scalar": ({"a.npy": npy(np.int64(7))}, [], r"{d}/a\.npy: expected a 1-D array of integer"),
    "npy negative id": ({"a.npy": npy(np.r_[np.arange(100), -3, np.arange(1000)].astype(np.int32))}, [],
                        r"{d}/a\.npy: token id -3 at window 1 is outside the vocabulary"),
    "npy out-of-vocabulary id": ({"a.npy": npy(np.r_[np.arange(100), VOCAB, np.arange(1000)].astype(np.int32))}, [],
                                 rf"{{d}}/a\.npy: token id {VOCAB} at window 1 is outside the vocabulary of {VOCAB}"),
    "npy too few tokens": ({"a.npy": npy(np.arange(10, dtype=np.uint16))}, [], r"'{d}/a\.npy': fewer than seq_len \+ 1"),
    "bin odd byte count": ({"a.bin": np.arange(1000, dtype=np.uint16).tobytes()[:-1]}, [],
                           r"{d}/a\.bin: cannot read token ids"),
    "bin empty": ({"a.bin": b""}, [], r"{d}/a\.bin: cannot read token ids"),
    "bin wrong dtype (uint32 read as uint16)": ({"a.bin": np.full(2000, 70000, np.uint32).tobytes()},
                                                ["token_dtype: uint16"], r"{d}/a\.bin: token id 4464 at window 0"),
    "bin uint32 out of vocabulary": ({"a.bin": np.full(2000, 70000, np.uint32).tobytes()}, ["token_dtype: uint32"],
                                     r"{d}/a\.bin: token id 70000 at window 0 is outside the vocabulary"),
    # -- missing files
    "missing file": ({}, ["path: {d}/nothing.jsonl"], r"data source '{d}/nothing\.jsonl': no such file"),
    "glob matching nothing": ({"a.jsonl": jsonl(*GOOD[:12])}, ["path: {d}/*.parquet"],
                              r"data source '{d}/\*\.parquet': no such file"),
    "directory without data files": ({"notes.md": b"# notes\n"}, ["path: {d}"], r"data source '{d}': no .*files"),
    "broken symlink": ({"@a.jsonl": b"{d}/gone.jsonl"}, [], r"data source '{d}/a\.jsonl': no such file"),
    "unknown extension": ({"a.xls": b"text\nx\n"}, [], r"{d}/a\.xls: cannot tell the format"),
    "mixed formats in a glob": ({"a.jsonl": jsonl(*GOOD[:12]), "b.txt": b"x = 1\n"}, ["path: {d}/*"],
                                r"data source '{d}/\*': mixes"),
    "missing token file": ({}, ["path: {d}/none.npy"], r"data source '{d}/none\.npy': no such file"),
    "hf_disk on a plain folder": ({"notes.md": b"x"}, ["path: {d}", "format: hf_disk"],
                                  r"{d}: not a directory written by datasets' save_to_disk"),
    "a directory named like a file": ({"a.jsonl/b.md": b"x"}, [], r"{d}/a\.jsonl/b\.md: cannot tell the format"),
    # -- FIFOs and devices: refused at open, never read (a FIFO would block, /dev/zero never end)
    "FIFO as a source": ({"|a.jsonl": b""}, [],
                         r"data source '{d}/a\.jsonl' is a FIFO, not a regular file; give a file"),
    "FIFO in a directory": ({"a.jsonl": jsonl(*GOOD[:12]), "|b.jsonl": b""}, ["path: {d}"],
                            r"data source '{d}': {d}/b\.jsonl is a FIFO, not a regular file"),
    "FIFO as a token file": ({"|a.npy": b""}, [], r"data source '{d}/a\.npy' is a FIFO, not a regular file"),
    "/dev/zero as a source": ({}, ["path: /dev/zero"], r"data source '/dev/zero' is a character device, not a regular"),
    "/dev/null as a source": ({}, ["path: /dev/null", "format: text"],
                              r"data source '/dev/null' is a character device, not a regular"),
    "/dev/zero as a token file": ({}, ["path: /dev/zero", "format: tokens"],
                                  r"data source '/dev/zero' is a character device, not a regular"),
    "a .txt linked to /dev/zero": ({"@a.txt": b"/dev/zero"}, [], r"data source '{d}/a\.txt' is a character device"),
    # -- NUL bytes: UTF-8 takes them, but they are binary data, never text
    "txt of NUL bytes": ({"a.txt": b"\x00" * 4096}, [],
                         r"{d}/a\.txt: binary data, not UTF-8 text \(a NUL byte at offset 0\)"),
    "txt lines with NUL bytes": ({"a.txt": b"x = 1\n" * 9 + b"y = \x00\x00\n" + b"z = 2\n" * 9}, ["text_unit: line"],
                                 r"{d}/a\.txt:10: binary data, not UTF-8 text \(a NUL byte at offset 58\)"),
    "skip: txt of NUL bytes": ({"a.txt": b"\x00" * 4096}, ["ON_BAD skip"],
                               r"'a' \({d}/a\.txt\): every one of the \d+ documents .* was skipped as bad"),
    # -- data.tokenizer folders that hold no usable tokenizer
    "tokenizer: tokenizer.json is {}": ({"a.jsonl": jsonl(*GOOD[:12]), "tok/tokenizer.json": b"{}"},
                                        ["SET data.tokenizer={d}/tok"],
                                        (r"data\.tokenizer: {d}/tok/tokenizer\.json is not a tokenizer the tokenizers "
                                         r"library reads \(.*\); write it with save_pretrained")),
    "tokenizer: tokenizer.json not JSON": ({"a.jsonl": jsonl(*GOOD[:12]), "tok/tokenizer.json": b"<html>"},
                                           ["SET data.tokenizer={d}/tok"],
                                           r"data\.tokenizer: {d}/tok/tokenizer\.json is not a tokenizer"),
    "tokenizer: tokenizer.json without added_tokens": ({"a.jsonl": jsonl(*GOOD[:12]), "tok/tokenizer.json": WORDS},
                                                       ["SET data.tokenizer={d}/tok"],
                                                       r"{d}/tok/tokenizer\.json has no \"added_tokens\" list"),
    "tokenizer: tokenizer_config.json a list": ({"a.jsonl": jsonl(*GOOD[:12]), "tok/tokenizer.json": WORDS_ADDED,
                                                 "tok/tokenizer_config.json": b"[]"}, ["SET data.tokenizer={d}/tok"],
                                                r"{d}/tok/tokenizer_config\.json holds a JSON array, not an object"),
    "tokenizer: folder without a tokenizer": ({"a.jsonl": jsonl(*GOOD[:12]), "tok/README.md": b"# notes\n"},
                                              ["SET data.tokenizer={d}/tok"],
                                              r"data\.tokenizer: {d}/tok holds no tokenizer: expected tokenizer\.json"),
    # -- SFT records
    "sft no known shape": ({"a.jsonl": sft_then({"question": "q", "answer": "a"})}, ["MODE sft"],
                           r"{d}/a\.jsonl:5: record has none of messages, prompt/completion"),
    "sft prompt without completion": ({"a.jsonl": sft_then({"prompt": "q"})}, ["MODE sft"],
                                      r"{d}/a\.jsonl:5: record has none of messages, prompt/completion"),
    "sft completion not a string": ({"a.jsonl": sft_then({"prompt": "q", "completion": 4})}, ["MODE sft"],
                                    r"{d}/a\.jsonl:5: completion is a int, not a string"),
    "sft messages not a list": ({"a.jsonl": sft_then({"messages": "hi"})}, ["MODE sft"],
                                r"{d}/a\.jsonl:5: messages must be a non-empty list"),
    "sft empty messages": ({"a.jsonl": sft_then({"messages": []})}, ["MODE sft"],
                           r"{d}/a\.jsonl:5: messages must be a non-empty list"),
    "sft message without content": ({"a.jsonl": sft_then({"messages": [{"role": "user"}]})}, ["MODE sft"],
                                    r"{d}/a\.jsonl:5: messages\[0\] needs 'role' and 'content'"),
    "sft content not a string": ({"a.jsonl": sft_then({"messages": [{"role": "user", "content": ["x"]}]})},
                                 ["MODE sft"], r"{d}/a\.jsonl:5: messages\[0\]\.content is a list"),
    "sft no assistant turn": ({"a.jsonl": sft_then({"messages": CHAT[:1]})}, ["MODE sft"],
                              r"{d}/a\.jsonl:5: messages has no assistant turn"),
    "sft unknown role": ({"a.jsonl": sft_then({"messages": [{"role": "robot", "content": "x"}, CHAT[1]]})},
                         ["MODE sft"], r"{d}/a\.jsonl:5: the chat template fails .*unknown role robot"),
    "sft lone surrogate in a completion": ({"a.jsonl": sft_then('{"prompt": "q", "completion": "\\udfff"}')},
                                           ["MODE sft"], r"{d}/a\.jsonl:5: the record holds a lone surrogate"),
    "sft [INST] text without turns": ({"a.jsonl": sft_then({"text": "no turns here"})}, ["MODE sft"],
                                      r"{d}/a\.jsonl:5: field 'text' has no \[INST\]"),
    "sft example longer than seq_len": ({"a.jsonl": sft_then({"prompt": "two " * 100, "completion": "x"})},
                                        ["MODE sft"], r"'a' \({d}/a\.jsonl\) document 4: \d+ tokens do not fit data\.seq_len = 64"),
    # -- every record bad, with on_bad_data: skip
    "skip: every line malformed": ({"a.jsonl": b"{\n" * 30}, ["ON_BAD skip"],
                                   r"'a' \({d}/a\.jsonl\): every one of the \d+ documents .* was skipped"),
    "skip: every text missing": ({"a.jsonl": jsonl(*[{"body": "x"}] * 30)}, ["ON_BAD skip"],
                                 r"'a' \({d}/a\.jsonl\): every one of the \d+ documents .* was skipped"),
    "skip: every sft example longer than seq_len": (  # the packer skipped them forever
        {"a.jsonl": jsonl(*[{"prompt": "two " * 100, "completion": "x"}] * 30)}, ["MODE sft", "ON_BAD skip"],
        r"'a' \({d}/a\.jsonl\): none of the \d+ examples this stream reads fits data\.seq_len = 64 .* raise "
        r"data\.seq_len$"),
    # -- every text empty: nothing was skipped as bad, whatever on_bad_data says
    "every text empty": ({"a.jsonl": jsonl(*[{"text": ""}] * 30)}, [],
                         (r"'a' \({d}/a\.jsonl\): every one of the \d+ documents this stream reads is empty "
                          r"\(no text\), so there is nothing to train on; give the source documents with text$")),
    "skip: every text empty": ({"a.jsonl": jsonl(*[{"text": ""}] * 30)}, ["ON_BAD skip"],
                               r"'a' \({d}/a\.jsonl\): every one of the \d+ documents this stream reads is empty"),
    # -- the same, with the default tokenizer: a BPE trained on the sources first, skipping what it cannot read
    "trained tokenizer: malformed line": ({"a.jsonl": good_then("{")}, ["TRAIN_TOKENIZER"],
                                          r"{d}/a\.jsonl:5: malformed JSON"),
    "trained tokenizer: every line malformed": ({"a.jsonl": b"{\n" * 30}, ["TRAIN_TOKENIZER", "ON_BAD skip"],
                                                r"'a' \({d}/a\.jsonl\): every one of the \d+ documents"),
    "trained tokenizer: sft lone surrogate": ({"a.jsonl": sft_then('{"prompt": "\\ud800", "completion": "x"}')},
                                              ["TRAIN_TOKENIZER", "MODE sft"],
                                              r"{d}/a\.jsonl:5: the record holds a lone surrogate"),
    "trained tokenizer: parquet garbage": ({"a.parquet": GARBAGE}, ["TRAIN_TOKENIZER"],
                                           r"{d}/a\.parquet: not a readable Parquet file"),
    "trained tokenizer: npy garbage": ({"a.npy": GARBAGE}, ["TRAIN_TOKENIZER"], r"{d}/a\.npy: not a \.npy file"),
    # -- read by a DataLoader worker process (data.num_workers, 1 by default): the same line arrives from it
    "worker: malformed line": ({"a.jsonl": good_then("{")}, ["SET data.num_workers=1"],
                               r"{d}/a\.jsonl:5: malformed JSON"),
    "worker: negative token id": ({"a.npy": npy(np.r_[np.arange(100), -3, np.arange(1000)].astype(np.int32))},
                                  ["SET data.num_workers=1"], r"{d}/a\.npy: token id -3 at window 1"),
    # -- mixtures
    "mixture: second source bad": ({"a.jsonl": jsonl(*GOOD[:12]), "b.jsonl": good_then("{")},
                                   ["SOURCES [{path: {d}/a.jsonl, weight: 3}, {path: {d}/b.jsonl, weight: 1}]"],
                                   r"{d}/b\.jsonl:5: malformed JSON"),
    "mixture: negative weight": ({"a.jsonl": jsonl(*GOOD[:12])}, ["weight: -1"],
                                 r"data\.sources\.0\.weight.*greater than 0"),
    "mixture: zero weight": ({"a.jsonl": jsonl(*GOOD[:12])}, ["weight: 0"], r"data\.sources\.0\.weight"),
    "mixture: weight not a number": ({"a.jsonl": jsonl(*GOOD[:12])}, ["weight: heavy"], r"data\.sources\.0\.weight"),
    "mixture: infinite weight": ({"a.jsonl": jsonl(*GOOD[:12])}, ["weight: .inf"], r"data\.sources\.0\.weight"),
    "mixture: NaN weight": ({"a.jsonl": jsonl(*GOOD[:12])}, ["weight: .nan"], r"data\.sources\.0\.weight"),
    "mixture: path and hf_name": ({"a.jsonl": jsonl(*GOOD[:12])}, ["hf_name: x/y"], r"data\.sources\.0"),
    # -- sizes
    "size: a global batch of 10**9 sequences": ({"a.jsonl": jsonl(*GOOD[:12])},
                                                ["SET train.global_batch_size=1000000000",
                                                 "SET train.micro_batch_size=4"],
                                                r"train\.global_batch_size = 1,000,000,000 puts"),
    "size: seq_len past the model's positions": ({"a.jsonl": jsonl(*GOOD[:12])}, ["SET data.seq_len=1000000000"],
                                                 r"data\.seq_len = 1000000000 is longer than"),
    "size: 10**9 tokens a sequence": ({"a.jsonl": jsonl(*GOOD[:12])},
                                      ["SET data.seq_len=1000000000", "POSITIONS 2000000000"],
                                      r"one training step needs at least [\d,.]+ GiB on each rank, more than the"),
    "size: a vocabulary of 2**31 logits": ({"a.jsonl": jsonl(*GOOD[:12])},
                                           ["SET model.config.vocab_size=2000000000", "SET train.loss=full"],
                                           r"one training step needs at least .*vocabulary 2,000,000,000"),
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE of VOCAB tokens with a chat template that refuses roles it does not know."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    bpe.train_from_iterator([r["text"] for r in GOOD[:100]], trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    assert bpe.get_vocab_size() == VOCAB
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_ROLES + CHAT_TEMPLATE
    out = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module", autouse=True)
def frozen_heap():
    """The trainer's gc.collect() on close scans only what a case made, not every module pytest has loaded."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def write_case(folder: Path, files: dict[str, bytes]) -> None:
    for name, content in files.items():
        if name.startswith("@"):  # a symbolic link to the path the content names
            (folder / name[1:]).symlink_to(content.decode().replace("{d}", str(folder)))
            continue
        if name.startswith("|"):  # a FIFO, which nothing ever writes to
            os.mkfifo(folder / name[1:])
            continue
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content)


def overrides_for(folder: Path, files: dict[str, bytes], extra: list[str], tokenizer: Path) -> list[str]:
    """--set values: the tiny run, this case's single source (its first file) and the case's own changes."""
    d = str(folder)
    source = {"path": f"{d}/{next(iter(files)).lstrip('@|')}" if files else d}
    sets, mode, on_bad, tokenizer_set = [], "pretrain", "error", [f"data.tokenizer={tokenizer}"]
    sources = None
    for item in extra:
        word, _, rest = item.partition(" ")
        if word == "SET":
            sets.append(rest.replace("{d}", d))
        elif word == "MODE":
            mode = rest
        elif word == "ON_BAD":
            on_bad = rest
        elif word == "SOURCES":
            sources = rest.replace("{d}", d)
        elif word == "TRAIN_TOKENIZER":
            tokenizer_set = ["data.vocab_size=300"]
        elif word == "POSITIONS":
            sets.append(f"model.config.max_position_embeddings={rest}")
        else:
            key, _, value = item.partition(": ")
            source[key] = value.replace("{d}", d) if key == "path" else yaml_value(value)
    return [*TINY, *tokenizer_set, "data.eval_fraction=0", f"data.mode={mode}",
            f"data.on_bad_data={on_bad}", f"data.sources={sources or json.dumps([source])}", "train.steps=2", *sets]


def yaml_value(text: str):
    import yaml

    return yaml.safe_load(text)


@pytest.mark.parametrize("case", CASES)
def test_bad_data_is_one_line_naming_the_file_and_touches_nothing(case, tmp_path, tokenizer_dir, capfd):
    files, extra, expected = CASES[case]
    folder = tmp_path / "data"
    folder.mkdir()
    write_case(folder, files)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("kept\n")  # what a run directory held before must still be there, alone
    code = main(["train", *(f"--set={o}" for o in overrides_for(folder, files, extra, tokenizer_dir)),
                 f"--set=train.run_dir={run_dir}"])
    out, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, (code, out[-2000:], err[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    assert "Traceback" not in out + err
    assert re.search(expected.replace("{d}", re.escape(str(folder))), lines[0]), lines[0]
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]
    assert (run_dir / "notes.txt").read_text() == "kept\n"


def test_the_table_covers_sixty_cases():
    assert len(CASES) >= 60


def test_bad_data_met_on_resume_loses_no_checkpoint(tmp_path, tokenizer_dir, capfd):
    """A record that went bad after the last save: the resumed run stops in one line, every checkpoint as it was."""
    data = tmp_path / "a.jsonl"
    data.write_bytes(jsonl(*GOOD[:12]))
    run = [*overrides_for(tmp_path, {"a.jsonl": b""}, [], tokenizer_dir), f"train.run_dir={tmp_path / 'run'}"]
    assert main(["train", *(f"--set={o}" for o in run)]) == 0
    saved = {p: p.read_bytes() for p in (tmp_path / "run" / "checkpoints").rglob("*") if p.is_file()}
    assert saved
    data.write_bytes(good_then('{"text": "x",}', at=5, total=12))  # the same count of records: the resume is allowed
    capfd.readouterr()
    code = main(["train", *(f"--set={o}" for o in run), "--set=train.steps=4"])
    out, err = capfd.readouterr()
    assert code == 2 and err.strip().splitlines() == [err.strip()], err[-3000:]
    assert re.fullmatch(rf"error: {re.escape(str(data))}:5: malformed JSON .*", err.strip()), err
    assert "Traceback" not in out + err
    assert {p: p.read_bytes() for p in (tmp_path / "run" / "checkpoints").rglob("*") if p.is_file()} == saved
    assert json.loads((tmp_path / "run" / "status.json").read_text())["state"] == "failed"
