""".venv/bin/python bench/big_document.py [--mb 45] [--train]

What one very large document costs to tokenize: the whole text through the tokenizer at once, as a list of
Python ints (how every document was encoded before), against `clustertrain.data.plan.encode_long` (pieces of
256 K characters into one int32 array, what a document longer than a piece now takes). Each way runs in a
fresh process of its own, so each peak RSS (ru_maxrss) is its own; the two are printed side by side with the
growth over the process's RSS before tokenizing, and the time.

With --train, also the whole path: `clustertrain train` for 2 steps (8 streams, one rank, no workers) on the
document as a .txt file, first training its tokenizer, then with the tokenizer cached, and on a 200 KB slice of
it for the baseline of a run; each run's peak RSS and wall time.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast


def document(mb: float) -> str:
    line = "def f{0}(x):\n    return x * {0} + {1}  # the {0}th function of a very long file\n"
    lines, size, i = [], 0, 0
    while size < mb * 1e6:
        lines.append(line.format(i, i % 7))
        size += len(lines[-1])
        i += 1
    return "".join(lines)


def tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(document(0.2).splitlines(True), trainers.BpeTrainer(vocab_size=2000,
                                                                                special_tokens=["<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


def measure(way: str, mb: float) -> dict:
    from clustertrain.data.plan import encode_long

    tok, text = tokenizer(), document(mb)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    if way == "whole":
        ids = [*tok([text], add_special_tokens=False)["input_ids"][0], tok.eos_token_id]
    else:
        ids = encode_long(tok, text, tok.eos_token_id)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"way": way, "tokens": len(ids), "seconds": seconds, "peak_mb": peak, "growth_mb": peak - before}


def train_runs(mb: float) -> None:
    model = ("model.config={hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
             "num_key_value_heads: 2, max_position_embeddings: 256}")
    with tempfile.TemporaryDirectory() as tmp:
        text = document(mb)
        (Path(tmp) / "big.txt").write_text(text)
        (Path(tmp) / "slice.txt").write_text(text[:200_000])
        del text
        print("\nclustertrain train, 2 steps of 8 x 256 tokens, on one document")
        print(f"{'run':<36}{'seconds':>9}{'peak RSS MB':>13}")
        for n, (file, label) in enumerate((("slice.txt", "200 KB of it (a run's baseline)"),
                                           ("big.txt", f"{mb:g} MB, tokenizer trained on it"),
                                           ("big.txt", f"{mb:g} MB, tokenizer cached"))):
            sets = [model, "data.vocab_size=2000", "data.seq_len=256", "train.global_batch_size=8",
                    "train.micro_batch_size=4", "train.eval_every=0", "train.sample_tokens=0", "data.num_workers=0",
                    "train.steps=2", f"train.run_dir={tmp}/run-{n}", f"data.cache_dir={tmp}/cache",
                    f"data.sources=[{{path: {tmp}/{file}}}]"]
            start = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", TRAIN_AND_REPORT, *(f"--set={s}" for s in sets)],
                                 capture_output=True, text=True, check=True).stdout
            print(f"{label:<36}{time.perf_counter() - start:>9.1f}{float(out.strip().splitlines()[-1]):>13.0f}")


# One run of the CLI in a process of its own that prints its peak RSS in MB last.
TRAIN_AND_REPORT = """
import resource, sys
from clustertrain.cli import main
code = main(["train", *sys.argv[1:]])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
sys.exit(code)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[2])
    parser.add_argument("--mb", type=float, default=45.0, help="document size in MB of text")
    parser.add_argument("--way", choices=["whole", "pieces"], help=argparse.SUPPRESS)  # one measurement
    parser.add_argument("--train", action="store_true", help="also time clustertrain train on the document")
    args = parser.parse_args()
    if args.way:
        print(json.dumps(measure(args.way, args.mb)))
        return
    rows = []
    for way in ("whole", "pieces"):
        out = subprocess.run([sys.executable, __file__, "--mb", str(args.mb), "--way", way],
                             capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"one document of {args.mb:g} MB of text, {rows[0]['tokens']:,} tokens")
    print(f"{'way':<8}{'seconds':>9}{'peak RSS MB':>13}{'growth MB':>11}")
    for r in rows:
        print(f"{r['way']:<8}{r['seconds']:>9.1f}{r['peak_mb']:>13.0f}{r['growth_mb']:>11.0f}")
    print(f"pieces / whole: growth {rows[1]['growth_mb'] / rows[0]['growth_mb']:.2f}x, "
          f"time {rows[1]['seconds'] / rows[0]['seconds']:.2f}x")
    if args.train:
        train_runs(args.mb)


if __name__ == "__main__":
    main()
