from __future__ import annotations

import copy
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from clustertrain.data.sft import Example, render_example
from clustertrain.errors import DataError

SPECIAL_TOKENS = [
    "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
]
CHATML_STYLE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHAT = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "How many legs does a spider have?"},
    {"role": "assistant", "content": "A spider has eight legs."},
]
ANSWERS = ["Paris is the capital of France.", "A spider has eight legs."]


@pytest.fixture(scope="session")
def bpe() -> Tokenizer:
    """A byte-level BPE (~370 tokens) trained on generated sentences, with chat special tokens."""
    rng = random.Random(0)
    words = ("the a of is what how many does have capital france paris spider legs eight answer question "
             "please tell me about rivers cats dogs and or one short sentence you").split()
    lines = [" ".join(rng.choice(words) for _ in range(12)) + rng.choice(".?!") for _ in range(300)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(lines, trainer)
    return tokenizer


def wrap(bpe, template=CHATML_STYLE, bos="<s>", eos="</s>", adds_bos=False) -> PreTrainedTokenizerFast:
    backend = copy.deepcopy(bpe)
    if adds_bos:
        backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture
def tokenizer(bpe):
    return wrap(bpe)


def loss_spans(tokenizer, example: Example) -> list[str]:
    """The decoded runs of consecutive loss tokens."""
    runs, run = [], []
    for token, keep in zip(example.input_ids + [None], example.loss_mask + [False]):
        if keep:
            run.append(token)
        elif run:
            runs.append(tokenizer.decode(run, clean_up_tokenization_spaces=False))
            run = []
    return runs


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def test_chat_loss_falls_only_on_assistant_turns_and_their_end_token(tokenizer):
    example = render_example({"messages": CHAT}, tokenizer)
    assert loss_spans(tokenizer, example) == [answer + "<|end|>" for answer in ANSWERS]
    assert decode(tokenizer, example.input_ids) == tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert len(example.input_ids) == len(example.loss_mask)


def test_chat_masks_system_user_turns_and_role_headers(tokenizer):
    example = render_example({"messages": CHAT}, tokenizer)
    masked = decode(tokenizer, [t for t, keep in zip(example.input_ids, example.loss_mask) if not keep])
    assert masked == (
        "<|system|>\nYou answer in one short sentence.<|end|>\n<|user|>\nWhat is the capital of France?<|end|>\n"
        "<|assistant|>\n\n<|user|>\nHow many legs does a spider have?<|end|>\n<|assistant|>\n\n"
    )


def test_chat_with_eos_ending_turns_and_template_bos(bpe):
    tokenizer = wrap(bpe, LLAMA3_STYLE, bos="<|begin_of_text|>", eos="<|eot_id|>", adds_bos=True)
    example = render_example({"messages": CHAT}, tokenizer)
    assert loss_spans(tokenizer, example) == [answer + "<|eot_id|>" for answer in ANSWERS]
    assert example.input_ids.count(tokenizer.bos_token_id) == 1 and example.input_ids[0] == tokenizer.bos_token_id
    assert example.input_ids[-1] == tokenizer.eos_token_id and example.loss_mask[-1]


def test_chat_errors_name_the_location(bpe, tokenizer):
    with pytest.raises(DataError, match=r"^train.jsonl:3: .*tokenizer has no chat template"):
        render_example({"messages": CHAT}, wrap(bpe, template=None), location="train.jsonl:3")
    bad = [CHAT[1], {"role": "assistant", "content": ["Paris"]}]
    with pytest.raises(DataError, match=r"^train.jsonl:3: messages\[1\].content is a list, not a string$"):
        render_example({"messages": bad}, tokenizer, location="train.jsonl:3")
    with pytest.raises(DataError, match=r"^a:1: messages has no assistant turn"):
        render_example({"messages": CHAT[:2]}, tokenizer, location="a:1")
    with pytest.raises(DataError, match=r"messages\[0\] needs 'role' and 'content' \(got \['from', 'value'\]\)"):
        render_example({"messages": [{"from": "human", "value": "hi"}]}, tokenizer)


def test_chat_template_that_rewrites_earlier_turns_is_rejected(bpe):
    last_differs = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if loop.last %}<|end|>{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    with pytest.raises(DataError, match=r"^x:7: the chat template does not render messages\[:2\] as a prefix"):
        render_example({"messages": CHAT}, wrap(bpe, last_differs), location="x:7")
    raising = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(DataError, match=r"^x:7: the chat template fails on .*roles must alternate"):
        render_example({"messages": CHAT}, wrap(bpe, raising), location="x:7")


@pytest.mark.parametrize("adds_bos", [False, True])
def test_prompt_completion_loss_on_completion_and_eos(bpe, adds_bos):
    tokenizer = wrap(bpe, adds_bos=adds_bos)
    record = {"prompt": "Question: what is the capital of France?\nAnswer:", "completion": " Paris."}
    example = render_example(record, tokenizer)
    assert loss_spans(tokenizer, example) == [" Paris.</s>"]
    assert (example.input_ids[0] == tokenizer.bos_token_id) == adds_bos
    assert decode(tokenizer, example.input_ids) == ("<s>" if adds_bos else "") + record["prompt"] + " Paris.</s>"


def test_guanaco_single_turn(tokenizer):
    text = "<s>[INST] What is the capital of France? [/INST] Paris is the capital of France. </s>"
    example = render_example({"text": text}, tokenizer)
    assert loss_spans(tokenizer, example) == [" Paris is the capital of France. </s>"]
    assert example.input_ids[0] == tokenizer.bos_token_id and example.input_ids[-1] == tokenizer.eos_token_id
    assert decode(tokenizer, example.input_ids) == text


def test_guanaco_multi_turn_and_custom_field(tokenizer):
    text = "<s>[INST] q one? [/INST] a one. </s><s>[INST] q two? [/INST] a two."
    example = render_example({"conversation": text}, tokenizer, field="conversation")
    assert loss_spans(tokenizer, example) == [" a one. </s>", " a two."]
    assert decode(tokenizer, example.input_ids) == text


def test_guanaco_errors(tokenizer):
    with pytest.raises(DataError, match=r"^d.jsonl:2: field 'text' has no \[INST\] ... \[/INST\] turns$"):
        render_example({"text": "just some text </s>"}, tokenizer, location="d.jsonl:2")
    with pytest.raises(DataError, match=r"^d.jsonl:2: field 'text' is a int, not a string$"):
        render_example({"text": 3}, tokenizer, location="d.jsonl:2")


def test_missing_fields_and_non_string_completion(tokenizer):
    message = r"^f:1: record has none of messages, prompt/completion, or 'text' \(fields: id, prompt\)$"
    with pytest.raises(DataError, match=message):
        render_example({"prompt": "p", "id": 1}, tokenizer, location="f:1")
    with pytest.raises(DataError, match=r"^completion is a NoneType, not a string$"):
        render_example({"prompt": "p", "completion": None}, tokenizer)
