"""Meta's original Llama checkpoints in and out: a tiny Llama in Meta's layout (2 model-parallel shards,
params.json, a tiktoken tokenizer.model) imports with the logits of Meta's own model, trains, exports back."""

from __future__ import annotations

import argparse
import base64
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from clustertrain.checkpoint.export import import_hf, load_checkpoint_model
from clustertrain.checkpoint.meta import export_meta, import_meta
from clustertrain.model.weights import read_pth
from clustertrain.checkpoint.meta_tokenizer import special_tokens
from clustertrain.cli import export_cmd
from clustertrain.errors import CheckpointError, UserError
from helpers import run_cli, train

# A tiny Llama 3.1 as Meta writes it: ffn = 256 * ceil(int(1.5 * int(8 * 64 / 3)) / 256) = 256.
PARAMS = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 524, "multiple_of": 256,
          "ffn_dim_multiplier": 1.5, "norm_eps": 1e-05, "rope_theta": 500000.0, "use_scaled_rope": True}
FFN = 256
# Meta's model-parallel split of each weight: 0 along output rows, 1 along input columns, None replicated.
SPLIT = {"tok_embeddings": 0, "output": 0, "norm": None, "attention.wq": 0, "attention.wk": 0, "attention.wv": 0,
         "attention.wo": 1, "feed_forward.w1": 0, "feed_forward.w3": 0, "feed_forward.w2": 1, "attention_norm": None,
         "ffn_norm": None}
MERGES = [b"th", b"the", b" t", b" the", b"in", b"ing", b"er", b" a", b"an", b"and", b" and", b"on"]
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TEXT = "the thing and other things, 12345 in the end\n\n  and ing's Ünïcödé\t\tthe\r\n — <|eot_id|> and"


def meta_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 weights by Meta's names, large enough that attention is far from uniform."""
    g = torch.Generator().manual_seed(seed)
    d, q, kv, v = PARAMS["dim"], 64, 32, PARAMS["vocab_size"]
    shapes = {"tok_embeddings": (v, d)}
    for i in range(PARAMS["n_layers"]):
        shapes.update({f"layers.{i}.{n}": s for n, s in {
            "attention.wq": (q, d), "attention.wk": (kv, d), "attention.wv": (kv, d), "attention.wo": (d, q),
            "feed_forward.w1": (FFN, d), "feed_forward.w2": (d, FFN), "feed_forward.w3": (FFN, d),
            "attention_norm": (d,), "ffn_norm": (d,)}.items()})
    shapes.update({"norm": (d,), "output": (v, d)})
    return {f"{n}.weight": (1 + 0.1 * torch.randn(s, generator=g) if len(s) == 1
                            else 0.3 * torch.randn(s, generator=g)).to(torch.bfloat16) for n, s in shapes.items()}


def write_meta_folder(folder: Path, weights: dict[str, torch.Tensor], shards: int = 2) -> Path:
    """`weights` as Meta's consolidated shards, params.json and a tiny tiktoken tokenizer.model (256 bytes, 12
    merges; 256 special tokens follow, so 524 ids)."""
    folder.mkdir(parents=True, exist_ok=True)
    for rank in range(shards):
        shard = {}
        for name, tensor in weights.items():
            split = SPLIT[name.split(".", 2)[-1].removesuffix(".weight") if name.startswith("layers.")
                          else name.removesuffix(".weight")]
            shard[name] = tensor.clone() if split is None else tensor.chunk(shards, dim=split)[rank].clone()
        torch.save(shard, folder / f"consolidated.{rank:02d}.pth")
    (folder / "params.json").write_text(json.dumps(PARAMS))
    (folder / "tokenizer.model").write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in ranks().items()))
    return folder


def ranks() -> dict[bytes, int]:
    found = {bytes([b]): b for b in range(256)}
    for merge in MERGES:
        found[merge] = len(found)
    return found


def scaled(freqs: torch.Tensor) -> torch.Tensor:
    """Llama 3.1's rope frequencies (Meta's apply_scaling: factor 8, low 1, high 4, 8192 positions)."""
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4:
            out.append(freq)
        elif wavelen > 8192:
            out.append(freq / 8)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            out.append((1 - smooth) * freq / 8 + smooth * freq)
    return torch.tensor(out, dtype=torch.float64)


def reference_logits(weights: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Meta's Llama forward, written from its reference model: complex rotary over interleaved pairs."""
    w = {k: v.float() for k, v in weights.items()}
    heads, kv_heads, dim = PARAMS["n_heads"], PARAMS["n_kv_heads"], PARAMS["dim"]
    hd, (batch, length) = dim // heads, ids.shape
    freqs = scaled(1.0 / PARAMS["rope_theta"] ** (torch.arange(0, hd, 2).double() / hd))
    angles = torch.outer(torch.arange(length).double(), freqs)
    cis = torch.polar(torch.ones_like(angles), angles)

    def rms(x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + PARAMS["norm_eps"]) * g

    def rotate(x):
        pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * cis[None, :, None, :]).flatten(3).float()

    h = w["tok_embeddings.weight"][ids]
    mask = torch.full((length, length), float("-inf")).triu(1)
    for i in range(PARAMS["n_layers"]):
        layer = {k.split(".", 2)[2].removesuffix(".weight"): v for k, v in w.items() if k.startswith(f"layers.{i}.")}
        x = rms(h, layer["attention_norm"])
        q = rotate((x @ layer["attention.wq"].T).view(batch, length, heads, hd))
        k = rotate((x @ layer["attention.wk"].T).view(batch, length, kv_heads, hd)).repeat_interleave(2, dim=2)
        v = (x @ layer["attention.wv"].T).view(batch, length, kv_heads, hd).repeat_interleave(2, dim=2)
        scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(hd) + mask
        attended = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).reshape(batch, length, dim)
        h = h + attended @ layer["attention.wo"].T
        x = rms(h, layer["ffn_norm"])
        gated = F.silu(x @ layer["feed_forward.w1"].T) * (x @ layer["feed_forward.w3"].T)
        h = h + gated @ layer["feed_forward.w2"].T
    return rms(h, w["norm.weight"]) @ w["output.weight"].T


def ids() -> torch.Tensor:
    return torch.randint(0, PARAMS["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def hf_logits(folder: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    return model.eval()(ids()).logits


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    weights = meta_weights()
    return write_meta_folder(tmp_path_factory.mktemp("meta") / "original", weights), weights


@pytest.fixture(scope="module")
def snapshot(original, tmp_path_factory) -> Path:
    return import_meta(original[0], tmp_path_factory.mktemp("hf") / "llama")


def test_a_meta_checkpoint_imports_with_meta_s_logits_config_and_tokenizer(original, snapshot):
    assert torch.allclose(hf_logits(snapshot), reference_logits(original[1], ids()), atol=1e-4, rtol=1e-4)
    config = json.loads((snapshot / "config.json").read_text())
    assert (config["intermediate_size"], config["num_key_value_heads"], config["rope_theta"]) == (FFN, 2, 500000.0)
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_scaling"]["factor"] == 8.0
    assert not config["tie_word_embeddings"] and config["torch_dtype"] == "bfloat16"
    tokenizer = AutoTokenizer.from_pretrained(snapshot, local_files_only=True)
    assert len(tokenizer) == PARAMS["vocab_size"] and tokenizer.decode(tokenizer(TEXT).input_ids[1:]) == TEXT
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (config["bos_token_id"], config["eos_token_id"]) \
        == (268, 269)
    # Llama 3.1's special tokens, in Meta's order (Llama 3 had a reserved token where 3.1 has its pad)
    assert tokenizer.convert_ids_to_tokens([268 + 4, 268 + 9]) == ["<|finetune_right_pad_id|>", "<|eot_id|>"]
    assert special_tokens(False)[9] == "<|eot_id|>" and special_tokens(False)[4] == "<|reserved_special_token_2|>"


def test_the_imported_tokenizer_encodes_as_tiktoken_does(snapshot):
    tiktoken = pytest.importorskip("tiktoken")  # the cross-check only: the import itself does not need tiktoken
    specials = {token: len(ranks()) + i for i, token in enumerate(special_tokens(True))}
    encoding = tiktoken.Encoding("tiny", pat_str=LLAMA3_SPLIT, mergeable_ranks=ranks(), special_tokens=specials)
    tokenizer = AutoTokenizer.from_pretrained(snapshot, local_files_only=True)
    assert tokenizer(TEXT).input_ids == [268, *encoding.encode(TEXT, allowed_special="all")]


def test_meta_to_checkpoint_to_meta_gives_identical_tensors_and_logits(original, snapshot, tmp_path):
    ckpt = import_hf(snapshot, tmp_path / "ckpt")
    out = export_meta(ckpt, tmp_path / "meta", dtype=torch.bfloat16)
    assert sorted(p.name for p in out.iterdir()) == ["consolidated.00.pth", "params.json", "tokenizer.model"]
    exported = read_pth(out / "consolidated.00.pth")
    assert list(exported) == list(original[1])  # Meta's names, in Meta's order
    assert all(torch.equal(exported[name], tensor) for name, tensor in original[1].items())
    params = json.loads((out / "params.json").read_text())
    assert {k: v for k, v in params.items() if k not in ("multiple_of", "ffn_dim_multiplier")} == \
        {k: v for k, v in PARAMS.items() if k not in ("multiple_of", "ffn_dim_multiplier")}
    assert (out / "tokenizer.model").read_bytes() == (original[0] / "tokenizer.model").read_bytes()
    again = import_meta(out, tmp_path / "again")  # params.json's own multiple_of gives the same FFN width
    assert torch.equal(hf_logits(again), hf_logits(snapshot))
    model, _, _ = load_checkpoint_model(ckpt)
    with torch.no_grad():
        assert torch.equal(model(ids()).logits, hf_logits(snapshot))


@pytest.mark.dist
def test_an_imported_meta_checkpoint_trains_and_exports_back_through_the_cli(original, tmp_path):
    hf = tmp_path / "hf"
    result = run_cli("import", str(original[0]), str(hf))
    assert result.returncode == 0 and "model.path" in result.stdout, result.stderr
    run_dir = tmp_path / "run"
    train(run_dir, f"model.path={hf}", "model.config={}", "train.steps=2", "train.global_batch_size=4",
          "train.micro_batch_size=4", "data.seq_len=32", "train.sample_tokens=0")
    result = run_cli("export", "--format", "meta", str(run_dir), str(tmp_path / "meta"))
    assert result.returncode == 0, result.stderr
    trained = read_pth(tmp_path / "meta" / "consolidated.00.pth")
    assert trained.keys() == original[1].keys()
    assert all(trained[k].shape == v.shape for k, v in original[1].items())
    wq = "layers.0.attention.wq.weight"
    assert not torch.equal(trained[wq].float(), original[1][wq].float())  # trained
    assert (tmp_path / "meta" / "tokenizer.model").read_bytes() == (original[0] / "tokenizer.model").read_bytes()


class Payload:
    """Creates `marker` if unpickled by plain pickle: what an attacker would plant in a .pth."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def break_params(folder: Path, change) -> None:
    params = json.loads((folder / "params.json").read_text())
    change(params)
    (folder / "params.json").write_text(json.dumps(params))


def replace_in_shard(folder: Path, name: str, tensor: torch.Tensor) -> None:
    shard = torch.load(folder / "consolidated.01.pth")  # not memory-mapped: the file is replaced
    torch.save({**shard, name: tensor}, folder / "consolidated.01.pth")


BAD = {
    "no params.json": (lambda f: (f / "params.json").unlink(), "has no params.json"),
    "a params.json key missing": (lambda f: break_params(f, lambda p: p.pop("n_heads")), "has no 'n_heads'"),
    "params.json not JSON": (lambda f: (f / "params.json").write_text("{dim: 64"), "params.json is not JSON"),
    "shards that disagree on names": (
        lambda f: torch.save({k: v for k, v in torch.load(f / "consolidated.01.pth").items() if "norm" not in k},
                             f / "consolidated.01.pth"), "consolidated.01.pth and consolidated.00.pth disagree"),
    "shards that disagree with params.json": (lambda f: break_params(f, lambda p: p.update(n_layers=3)),
                                              "no layers.2.attention.wq.weight"),
    "another width": (lambda f: break_params(f, lambda p: p.update(multiple_of=512)),
                      r"layers.0.feed_forward.w1.weight is \(256, 64\) but params.json gives \(512, 64\)"),
    "shard pieces that do not fit": (lambda f: replace_in_shard(f, "layers.1.attention.wq.weight", torch.zeros(32, 6)),
                                     "pieces of layers.1.attention.wq.weight do not fit together"),
    "a params.json value of the wrong type": (lambda f: break_params(f, lambda p: p.update(n_kv_heads="2")),
                                              "n_kv_heads = '2' is not a whole number"),
    "no shards": (lambda f: [p.unlink() for p in f.glob("*.pth")], "no consolidated.NN.pth"),
    "not a tiktoken file": (lambda f: (f / "tokenizer.model").write_bytes(b"\x0a\x08sentencepiece 1 2\n"),
                            "tokenizer.model:2 is not a tiktoken line"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_meta_folders_are_one_line(original, tmp_path, case):
    folder = write_meta_folder(tmp_path / "bad", original[1])
    change, message = BAD[case]
    change(folder)
    with pytest.raises(CheckpointError, match=message) as error:
        import_meta(folder, tmp_path / "out")
    assert "\n" not in str(error.value) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["consolidated.01.pth", "model_state_dict.pt"])
def test_a_pth_holding_a_pickled_object_is_refused_without_running_it(original, tmp_path, name):
    folder = write_meta_folder(tmp_path / "planted", original[1])
    marker = tmp_path / "ran"
    torch.save({"tok_embeddings.weight": torch.zeros(2), "extra": Payload(marker)}, folder / name)
    with pytest.raises(CheckpointError, match=rf"{name} holds code or non-tensor objects \(it refers to io.open\)"):
        read_pth(folder / name)
    if name.startswith("consolidated"):
        with pytest.raises(CheckpointError, match="holds code"):
            import_meta(folder, tmp_path / "out")
    assert not marker.exists()


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="clustertrain")
    export_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


def test_push_to_hub_offline_is_one_line_before_anything_is_written(snapshot, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="HF_HUB_OFFLINE") as error:
        cli("export", "--format", "meta", str(snapshot), str(tmp_path / "out"), "--push-to-hub", "me/tiny")
    assert "\n" not in str(error.value) and not (tmp_path / "out").exists()
