"""Exported config and tokenizer files that load in the transformers releases users run, 4.5x as well as 5.x.

transformers 5 writes `rope_parameters` where 4.x reads `rope_theta` (silently falling back to 10,000 without it)
and `rope_scaling`, `dtype` where 4.x reads `torch_dtype`, and names its tokenizer class `TokenizersBackend`,
which 4.x does not have. The exported files carry both spellings; transformers 5 reads its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clustertrain.data.tokenize import PORTABLE_TOKENIZER, names_a_v5_only_class


def legacy_config_keys(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (a config.json's fields) with the 4.x names of its rope and dtype fields added beside 5.x's."""
    config = dict(config)
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type
        if "sliding_attention" in rope and "rope_theta" in rope["sliding_attention"]:
            config.setdefault("rope_local_base_freq", rope["sliding_attention"]["rope_theta"])
        rope = rope.get("full_attention") or next(iter(rope.values()))
    if isinstance(rope, dict):
        if "rope_theta" in rope:
            config.setdefault("rope_theta", rope["rope_theta"])
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") != "default":
            config.setdefault("rope_scaling", scaling)
    if config.get("dtype") is not None:
        config.setdefault("torch_dtype", config["dtype"])
    return config


def write_legacy_config(folder: Path) -> None:
    """Add the 4.x keys to `folder/config.json` in place."""
    file = folder / "config.json"
    file.write_text(json.dumps(legacy_config_keys(json.loads(file.read_text())), indent=2, sort_keys=True) + "\n")


def write_portable_tokenizer_class(folder: Path) -> None:
    """Name a class every release has in `folder/tokenizer_config.json`, if transformers 5 wrote one only it has."""
    file = folder / "tokenizer_config.json"
    if names_a_v5_only_class(folder):
        config = json.loads(file.read_text())
        config["tokenizer_class"] = PORTABLE_TOKENIZER
        file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
