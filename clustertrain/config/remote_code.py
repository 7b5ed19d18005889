"""clustertrain never runs Python code shipped in a model or tokenizer folder (transformers' `trust_remote_code`).

Every loader passes `trust_remote_code=False` and asks `custom_code` first, so that such a folder is one line
(exit 2) rather than transformers' prompt on a terminal or its error of several lines.
"""

from __future__ import annotations

import json
from pathlib import Path


def custom_code(folder: str | Path) -> str | None:
    """Why the model or tokenizer folder `folder` cannot load without running Python code it ships, or None.

    An `auto_map` in its config.json or tokenizer_config.json names such code; transformers runs it when trusted
    and asks on a terminal when not told. clustertrain never runs it: every loader passes
    `trust_remote_code=False`, and calls this first to refuse in one line. An auto_map beside a class transformers
    has (the config's model_type, the tokenizer's tokenizer_class) is harmless: that class is loaded instead.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    def known_tokenizer(name: str) -> bool:  # as AutoTokenizer looks a class up, with or without "Fast"
        name = name.removesuffix("Fast")
        return tokenizer_class_from_name(name) is not None or tokenizer_class_from_name(name + "Fast") is not None

    for name, field, known in (("config.json", "model_type", CONFIG_MAPPING.__contains__),
                               ("tokenizer_config.json", "tokenizer_class", known_tokenizer)):
        file = Path(folder) / name
        try:
            data = json.loads(file.read_bytes())
        except (OSError, ValueError):
            continue  # missing or unreadable: the loader names that
        if not isinstance(data, dict) or not data.get("auto_map"):
            continue
        value = data.get(field)
        if not (isinstance(value, str) and value and known(value)):
            return (f"{file}: auto_map asks to run Python code shipped with it, and clustertrain never runs code from "
                    f"a model or tokenizer folder; use a folder whose {field} is a transformers class (e.g. one saved "
                    f"with save_pretrained of a built-in class)")
    return None
