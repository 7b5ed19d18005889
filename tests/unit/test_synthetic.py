"""The synthetic instruction tasks, and greedy/sampled completion with exact-match scoring on a real tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from clustertrain.config.data_schema import DataConfig, SourceConfig
from clustertrain.data.synthetic import KINDS, is_correct, make_records, read_task, write_task
from clustertrain.data.tokenize import load_tokenizer
from clustertrain.errors import DataError
from clustertrain.inference import complete, encode_prompt, exact_match, load_for_inference


def test_same_seed_writes_the_same_files_and_another_seed_others(tmp_path):
    first = write_task(tmp_path / "a", n_train=300, n_test=50, seed=7)
    again = write_task(tmp_path / "b", n_train=300, n_test=50, seed=7)
    other = write_task(tmp_path / "c", n_train=300, n_test=50, seed=8)
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in again]
    assert [p.read_bytes() for p in first] != [p.read_bytes() for p in other]
    assert [p.name for p in first] == ["train.jsonl", "test.jsonl"]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_test_prompts_are_distinct_and_never_in_training(tmp_path, kind):
    train_path, test_path = write_task(tmp_path, n_train=1000, n_test=100, seed=0, kind=kind)
    train, test = read_task(train_path), read_task(test_path)
    assert len(train) == 1000 and len(test) == 100
    test_prompts = {r["prompt"] for r in test}
    assert len(test_prompts) == 100
    assert not test_prompts & {r["prompt"] for r in train}


def _symbols(text: str, after: str) -> list[str]:
    return text.removeprefix(after).removesuffix("=").split()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_completions_are_the_right_answers(kind):
    for record in make_records(kind, 200, seed=3):
        prompt, completion = record["prompt"], record["completion"]
        assert completion.startswith(" ") and prompt.endswith(" =")  # one token per symbol, as in training
        answer = completion.split()
        if kind == "reverse":
            assert answer == _symbols(prompt, "reverse:")[::-1]
        elif kind == "upper":
            assert answer == [s.upper() for s in _symbols(prompt, "upper:")]
        else:
            a, b = "".join(_symbols(prompt, "add:")).split("+")
            assert "".join(answer) == str(int(a) + int(b))
            assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99


def test_is_correct_is_exact_match_after_strip():
    assert is_correct(" c b a\n", "c b a")
    assert not is_correct(" c b a b", " c b a")
    assert not is_correct(" c  b a", " c b a")
    assert not is_correct("C B A", " c b a")


def test_bad_requests_and_files_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="unknown task kind 'sort'"):
        make_records("sort", 10, seed=0)
    with pytest.raises(DataError, match="too few distinct prompts"):
        make_records("add", 90 * 90 + 1, seed=0)  # only 90 x 90 sums of two 2-digit numbers
    with pytest.raises(DataError, match="no such file"):
        read_task(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n" + json.dumps({"prompt": "p"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: needs string fields 'prompt' and 'completion'"):
        read_task(bad)
    bad.write_text("{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: not JSON"):
        read_task(bad)


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    """A 2-layer Llama with random weights and the byte-level BPE training would build for the task."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("task")
    train_path, test_path = write_task(folder, n_train=500, n_test=40, seed=0)
    data = DataConfig(mode="sft", sources=[SourceConfig(path=str(train_path))], vocab_size=300,
                      cache_dir=str(folder / "cache"))
    tokenizer = load_tokenizer(data)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config).eval(), tokenizer, read_task(test_path)


def test_letters_are_one_token_each_so_prompts_are_short(random_model):
    _, tokenizer, records = random_model
    for record in records:
        assert len(encode_prompt(tokenizer, record["prompt"])) < 12
        assert len(tokenizer.encode(record["completion"])) == len(record["completion"].split())


def test_untrained_model_scores_near_zero(random_model):
    model, tokenizer, records = random_model
    result = exact_match(model, tokenizer, records)
    assert result["n"] == 40 and result["accuracy"] < 0.1
    assert result["max_new_tokens"] == 6  # 5 letters at most, then EOS
    assert [e["expected"] for e in result["examples"]] == [r["completion"] for r in records]
    assert all(e["correct"] == is_correct(e["answer"], e["expected"]) for e in result["examples"])


def test_left_padded_batches_give_the_same_text_as_one_prompt_at_a_time(random_model):
    model, tokenizer, records = random_model
    prompts = [r["prompt"] for r in records[:12]]
    assert len({len(encode_prompt(tokenizer, p)) for p in prompts}) > 1  # so some rows are padded
    batched = complete(model, tokenizer, prompts, max_new_tokens=6, batch_size=12)
    single = complete(model, tokenizer, prompts, max_new_tokens=6, batch_size=1)
    assert batched == single
    assert any(text for text in batched)


def test_an_empty_prompt_starts_from_a_document_boundary(random_model):
    model, tokenizer, _ = random_model
    [text] = complete(model, tokenizer, [""], max_new_tokens=4)
    assert text == complete(model, tokenizer, [tokenizer.eos_token], max_new_tokens=4)[0]


def test_sampling_repeats_with_its_seed_and_tiny_top_p_is_greedy(random_model):
    model, tokenizer, records = random_model
    prompts = [r["prompt"] for r in records[:8]]
    state = torch.random.get_rng_state()
    sampled = complete(model, tokenizer, prompts, max_new_tokens=6, temperature=1.0, seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random state is untouched
    assert complete(model, tokenizer, prompts, max_new_tokens=6, temperature=1.0, seed=1) == sampled
    assert complete(model, tokenizer, prompts, max_new_tokens=6, temperature=1.0, seed=2) != sampled
    greedy = complete(model, tokenizer, prompts, max_new_tokens=6)
    assert greedy != sampled
    assert complete(model, tokenizer, prompts, max_new_tokens=6, temperature=1.0, top_p=1e-6, seed=2) == greedy


def test_exported_directory_loads_with_its_tokenizer(random_model, tmp_path):
    model, tokenizer, records = random_model
    model.save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    loaded, loaded_tokenizer = load_for_inference(tmp_path / "hf")
    prompts = [r["prompt"] for r in records[:4]]
    assert complete(loaded, loaded_tokenizer, prompts, max_new_tokens=6) == complete(
        model, tokenizer, prompts, max_new_tokens=6)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # peft calls a transformers method renamed in v5
def test_lora_adapter_directory_loads_on_its_base(random_model, tmp_path):
    import peft

    model, tokenizer, records = random_model
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM")
    adapted = peft.get_peft_model(model, config).eval()  # random lora_B: the adapter changes the output
    adapted.peft_config["default"].base_model_name_or_path = str(tmp_path / "base")  # as export writes it
    adapted.save_pretrained(tmp_path / "adapter")  # no tokenizer: the base model's is used
    prompts = [r["prompt"] for r in records[:6]]
    expected = complete(adapted, tokenizer, prompts, max_new_tokens=6)
    with adapted.disable_adapter():
        base_text = complete(adapted, tokenizer, prompts, max_new_tokens=6)
    adapted.unload()  # give the shared module its plain layers back
    loaded, loaded_tokenizer = load_for_inference(tmp_path / "adapter")
    assert isinstance(loaded, peft.PeftModel)
    assert complete(loaded, loaded_tokenizer, prompts, max_new_tokens=6) == expected != base_text
