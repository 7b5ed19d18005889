""".venv/bin/python bench/export.py

How much memory does `clustertrain export` take? Peak RSS of exporting one checkpoint of a ~134M-parameter Llama
(hidden 768, 12 layers, vocabulary 32,000: 537 MB in fp32), each way in a fresh process:

    .venv/bin/python bench/export.py                       # in a temp dir, removed at the end
    .venv/bin/python bench/export.py --dir /scratch/$USER --keep --layers 24

* whole: what `export` did before it streamed: `load_checkpoint_model` (the whole model on CPU in fp32, loaded
  from the checkpoint) then `save_pretrained`.
* stream fp32 / stream bf16: `export_hf` with `--dtype` fp32 / bf16 and the default 2 GB shards, and with
  `--max-shard-size 200MB`: the model is only built on the meta device, and one shard of tensors is read, cast
  and written at a time.

Each process reports its own peak RSS (`VmHWM`) and its RSS after imports (torch and transformers, before any
tensor), so "above imports" is what the export itself cost. The checkpoint is written once by
`clustertrain.checkpoint.export.import_hf` from a randomly initialised model (weights only; the export never reads
optimizer state). The written files are checked to load with the same logits (fp32) in transformers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAYS = {"whole": [], "stream fp32": ["fp32"], "stream bf16": ["bf16"], "stream bf16 200MB": ["bf16", "200MB"]}


def status_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process. Not ru_maxrss: Linux carries that over exec from the forking
    parent, so a child of a large parent would report the parent's size."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def child(way: str, checkpoint: str, out: str) -> None:
    """Export `checkpoint` to `out` one way; print {"imports_mb", "peak_mb"} as JSON."""
    sys.path.insert(0, str(ROOT))
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from clustertrain.checkpoint.export import export_hf, load_checkpoint_model

    imports = status_mb("VmRSS")
    if way == "whole":
        model, _, _ = load_checkpoint_model(checkpoint)
        model.save_pretrained(out)
    else:
        dtype, *shard = WAYS[way]
        export_hf(checkpoint, out, dtype=getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype]),
                  max_shard_size=shard[0] if shard else "2GB")
    peak = status_mb("VmHWM")
    print(json.dumps({"imports_mb": imports, "peak_mb": peak}))


def make_checkpoint(folder: Path, layers: int) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(ROOT))
    from clustertrain.checkpoint.export import import_hf

    config = AutoConfig.for_model("llama", hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
                                  num_attention_heads=12, num_key_value_heads=12, vocab_size=32000)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder / "hf")
    del model
    import_hf(folder / "hf", folder / "checkpoint")
    print(f"model: llama, {params / 1e6:.1f}M parameters, {params * 4 / 1e6:.0f} MB in fp32")
    return folder / "checkpoint"


def same_logits(reference: Path, exported: Path) -> bool:
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)(ids).logits
        b = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)(ids).logits
    return torch.equal(a, b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="where to write the checkpoint and exports (default: temp)")
    parser.add_argument("--layers", type=int, default=12, help="decoder layers (default 12: 134M parameters)")
    parser.add_argument("--keep", action="store_true", help="keep the files")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    folder = Path(tempfile.mkdtemp(prefix="bench-export-", dir=args.dir))
    try:
        checkpoint = make_checkpoint(folder, args.layers)
        print(f"{'way':<20}{'peak RSS MB':>12}{'after imports':>15}{'above imports':>15}  files")
        for i, way in enumerate(WAYS):
            out = folder / f"out-{i}"
            result = subprocess.run([sys.executable, __file__, "--child", way, str(checkpoint), str(out)],
                                    capture_output=True, text=True, check=True)
            figures = json.loads(result.stdout.strip().splitlines()[-1])
            size = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1e6
            files = f"{len(list(out.glob('*.safetensors')))} safetensors, {size:.0f} MB"
            if way == "stream fp32":
                files += ", logits equal to the model's" if same_logits(folder / "hf", out) else ", LOGITS DIFFER"
            print(f"{way:<20}{figures['peak_mb']:>12.0f}{figures['imports_mb']:>15.0f}"
                  f"{figures['peak_mb'] - figures['imports_mb']:>15.0f}  {files}")
    finally:
        if args.keep:
            print(f"kept {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
