"""Supervised fine-tuning records as token ids with a loss mask: the loss falls only on the responses.

Three record shapes are read, detected in this order:

    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    {"prompt": "Translate 'chat': ", "completion": "cat"}
    {"text": "<s>[INST] What is X? [/INST] X is ... </s>"}      # Llama-2 style, as in guanaco-llama2-1k

Every shape is split into prompt and response pieces at the string level; each piece is tokenized on its
own (without the tokenizer's automatic special tokens) and the ids are concatenated. A response thus
starts on a token boundary, and its tokens are the ones a model would generate after the prompt.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from clustertrain.data.readers import check_text
from clustertrain.errors import DataError


_LLAMA2_MARKERS = re.compile(r"(<s>|</s>|\[INST\]|\[/INST\])")


@dataclass
class Example:
    """One record's tokens; `loss_mask[i]` is True where token i is part of a response."""

    input_ids: list[int]
    loss_mask: list[bool]


def render_example(record: dict, tokenizer, *, field: str = "text", location: str = "") -> Example:
    """Tokenize one SFT record and mark its response tokens.

    Args:
        record: a dict with `messages`, or `prompt` and `completion`, or `field` in the Llama-2 `[INST]` style.
        tokenizer: a Hugging Face tokenizer; `messages` needs its chat template.
        field: the text field of the `[INST]` style.
        location: where the record comes from (e.g. `data.jsonl:12`), to begin error messages with.

    Raises:
        DataError: the record has no known shape, a value is not a string, or the chat template cannot be
            split into turns.
    """
    where = f"{location}: " if location else ""
    if "messages" in record:
        pieces = _chat_pieces(record["messages"], tokenizer, where)
    elif "prompt" in record and "completion" in record:
        pieces = _prompt_completion_pieces(record, tokenizer, where)
    elif field in record:
        pieces = _llama2_pieces(record[field], tokenizer, field, where)
    else:
        raise DataError(
            f"{where}record has none of messages, prompt/completion, or '{field}' (fields: {', '.join(sorted(record))})"
        )
    input_ids: list[int] = []
    loss_mask: list[bool] = []
    for piece, is_response in pieces:
        if isinstance(piece, str):
            check_text(piece, f"{where}the record")
        ids = [piece] if isinstance(piece, int) else tokenizer.encode(piece, add_special_tokens=False)
        input_ids += ids
        loss_mask += [is_response] * len(ids)
    return Example(input_ids, loss_mask)


# A piece is text to tokenize, or one token id already chosen, with whether it is part of a response.
_Piece = tuple[str | int, bool]


def _chat_pieces(messages, tokenizer, where: str) -> list[_Piece]:
    """Split the rendered conversation at the character spans that each assistant message adds.

    The template is rendered to a string (it writes BOS and the turn markers itself, hence tokenizing
    with add_special_tokens=False). Rendering messages[:i] with the generation prompt ends where
    assistant message i starts; rendering messages[:i+1] ends where it stops. That holds only if each
    rendering is a prefix of the next, which is checked; tokenizing the pieces separately then makes
    the token ids prefix-stable too.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}the record has messages but the tokenizer has no chat template")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}messages must be a non-empty list of {{'role': ..., 'content': ...}}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
            keys = sorted(message) if isinstance(message, dict) else type(message).__name__
            raise DataError(f"{where}messages[{i}] needs 'role' and 'content' (got {keys})")
        for key in ("role", "content"):
            if not isinstance(message[key], str):
                raise DataError(f"{where}messages[{i}].{key} is a {type(message[key]).__name__}, not a string")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise DataError(f"{where}messages has no assistant turn, so nothing to train on")

    full = _render(tokenizer, messages, False, where)
    pieces: list[_Piece] = []
    done = 0
    for i in turns:
        before = _render(tokenizer, messages[:i], True, where)
        through = _render(tokenizer, messages[: i + 1], False, where)
        if not (through.startswith(before) and full.startswith(through)) or len(before) < done:
            raise DataError(
                f"{where}the chat template does not render messages[:{i}] as a prefix of the longer conversation, "
                "so the assistant turns cannot be located; use a template that only appends turns"
            )
        # Whitespace after the end-of-turn token belongs to the layout of the next turn, not to the answer.
        end = max(len(before), len(through.rstrip()))
        pieces += [(full[done : len(before)], False), (full[len(before) : end], True)]
        done = end
    pieces.append((full[done:], False))
    return [(text, is_response) for text, is_response in pieces if text]


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja2 errors, raise_exception() in templates, ValueError on an empty list
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise DataError(f"{where}the chat template fails on the first {len(messages)} messages: {first}") from None


def _prompt_completion_pieces(record: dict, tokenizer, where: str) -> list[_Piece]:
    """BOS (if the tokenizer adds one by default), the prompt, then the completion and EOS as the response.

    The two strings are joined as given: put any separating space or newline into one of them.
    """
    for key in ("prompt", "completion"):
        if not isinstance(record[key], str):
            raise DataError(f"{where}{key} is a {type(record[key]).__name__}, not a string")
    if tokenizer.eos_token_id is None:
        raise DataError(f"{where}the tokenizer defines no eos_token to end the completion with")
    pieces: list[_Piece] = [(record["prompt"], False), (record["completion"], True), (tokenizer.eos_token_id, True)]
    if adds_bos(tokenizer):
        pieces.insert(0, (tokenizer.bos_token_id, False))
    return pieces


def adds_bos(tokenizer) -> bool:
    """Whether plain `tokenizer(text)` starts with BOS (Llama-style tokenizers do, GPT-2-style ones do not)."""
    if tokenizer.bos_token_id is None:
        return False
    default, plain = tokenizer.encode("x"), tokenizer.encode("x", add_special_tokens=False)
    return len(default) > len(plain) and default[0] == tokenizer.bos_token_id


def _llama2_pieces(text, tokenizer, field: str, where: str) -> list[_Piece]:
    """The response of each turn is the text after `[/INST]` up to and including its `</s>` (or the end).

    `<s>` and `</s>` become the tokenizer's BOS and EOS ids where it has them, else they stay text.
    `[INST]` and `[/INST]` stay text, as in Llama-2 itself.
    """
    if not isinstance(text, str):
        raise DataError(f"{where}field '{field}' is a {type(text).__name__}, not a string")
    if "[INST]" not in text or "[/INST]" not in text:
        raise DataError(f"{where}field '{field}' has no [INST] ... [/INST] turns")
    pieces: list[_Piece] = []
    in_response = False
    for part in _LLAMA2_MARKERS.split(text):
        if part == "[/INST]":
            pieces.append((part, False))
            in_response = True
        elif part == "</s>":
            pieces.append((_id_or_text(part, tokenizer.eos_token_id), in_response))
            in_response = False
        elif part in ("<s>", "[INST]"):
            # A new turn ends the previous answer even if it lacked its </s>.
            pieces.append((_id_or_text(part, tokenizer.bos_token_id) if part == "<s>" else part, False))
            in_response = False
        elif part:
            pieces.append((part, in_response))
    return pieces


def _id_or_text(marker: str, token_id: int | None) -> str | int:
    return marker if token_id is None else token_id
