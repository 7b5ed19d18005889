"""`clustertrain download`: skip, force and verify against a local fake repo; the hub itself is never called."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub.utils.sha import git_hash
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import write_tiny_repo

from clustertrain.cli import main
from clustertrain.errors import DataError
from clustertrain.model import download as dl
from clustertrain.model.download import download, local_fetch, read_manifest, resolve_hub_id

REPO = "org/tiny-llama"


@pytest.fixture(scope="module")
def fake_repo(tmp_path_factory) -> Path:
    """A directory laid out like a hub model repo: a tiny Llama and a trained tokenizer."""
    repo = write_tiny_repo(tmp_path_factory.mktemp("fake-repo"))
    (repo / ".git").mkdir()
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")  # a clone's metadata is not part of the repo
    return repo


class CountingFetch:
    """`local_fetch` of the fake repo, counting its calls."""

    def __init__(self, source: Path):
        self.fetch, self.calls = local_fetch(source), 0

    def __call__(self, *args, **patterns) -> Path:
        self.calls += 1
        return self.fetch(*args, **patterns)


def repo_files(repo: Path) -> set[str]:
    return {p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts}


def flip_last_byte(path: Path) -> None:
    """Change a file's content in place, keeping its size (what only a re-hash can see)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))


def test_download_fetches_once_then_skips(fake_repo, tmp_path):
    fetch = CountingFetch(fake_repo)
    first = download(REPO, cache_dir=tmp_path, fetch=fetch)
    assert (first.fetched, first.reason, fetch.calls) == (True, "not in the cache", 1)
    assert first.snapshot.parent == tmp_path / "models--org--tiny-llama" / "snapshots"
    assert (tmp_path / "models--org--tiny-llama" / "refs" / "main").read_text() == first.snapshot.name
    assert repo_files(first.snapshot) == repo_files(fake_repo) == set(read_manifest(first.snapshot))
    assert first.files == len(repo_files(fake_repo))
    assert first.size_bytes == sum((fake_repo / name).stat().st_size for name in repo_files(fake_repo))

    second = download(REPO, cache_dir=tmp_path, fetch=fetch)
    assert (second.fetched, second.reason, fetch.calls) == (False, "already complete", 1)
    assert second.snapshot == first.snapshot


def test_force_fetches_again_and_repairs(fake_repo, tmp_path):
    fetch = CountingFetch(fake_repo)
    snapshot = download(REPO, cache_dir=tmp_path, fetch=fetch).snapshot
    flip_last_byte(snapshot / "model.safetensors")
    assert not download(REPO, cache_dir=tmp_path, fetch=fetch).fetched  # same size: only a re-hash sees it

    forced = download(REPO, cache_dir=tmp_path, fetch=fetch, force=True)
    assert (forced.fetched, forced.reason, fetch.calls) == (True, "--force", 2)
    assert download(REPO, cache_dir=tmp_path, fetch=fetch, verify=True).verified
    assert (snapshot / "model.safetensors").read_bytes() == (fake_repo / "model.safetensors").read_bytes()


def test_verify_names_each_changed_file(fake_repo, tmp_path):
    snapshot = download(REPO, cache_dir=tmp_path, fetch=local_fetch(fake_repo)).snapshot
    flip_last_byte(snapshot / "model.safetensors")
    flip_last_byte(snapshot / "tokenizer.json")
    with pytest.raises(DataError) as error:
        download(REPO, cache_dir=tmp_path, fetch=local_fetch(fake_repo), verify=True)
    message = str(error.value)
    assert "model.safetensors has a different sha256" in message and "tokenizer.json has a different sha256" in message
    assert "config.json" not in message and "\n" not in message
    assert f"clustertrain download {REPO} --force" in message


def test_truncated_or_missing_files_are_fetched_again(fake_repo, tmp_path):
    fetch = CountingFetch(fake_repo)
    snapshot = download(REPO, cache_dir=tmp_path, fetch=fetch).snapshot
    full = (snapshot / "config.json").stat().st_size
    os.chmod(snapshot / "config.json", 0o644)
    with open(snapshot / "config.json", "r+b") as f:
        f.truncate(10)
    (snapshot / "tokenizer.json").unlink()

    blob = (snapshot / "config.json").resolve()

    def hub_like_fetch(*args) -> Path:
        """The hub client keeps files it finds in the snapshot: the bad ones must be gone before it runs."""
        assert not (snapshot / "config.json").exists() and not blob.exists()
        assert (snapshot / "model.safetensors").exists()
        return fetch(*args)

    again = download(REPO, cache_dir=tmp_path, fetch=hub_like_fetch, verify=True)
    assert again.fetched and fetch.calls == 2
    assert again.reason == f"incomplete: config.json has 10 bytes, expected {full}; tokenizer.json is missing"
    assert not dl.file_problems(snapshot, read_manifest(snapshot), rehash=True)


def test_a_download_that_does_not_match_the_hubs_hash_is_refused(fake_repo, tmp_path):
    """The hub names a blob by its sha256 (LFS) or git blob id: a fetch whose bytes differ is caught."""
    def corrupting_fetch(*args) -> Path:
        snapshot = local_fetch(fake_repo)(*args)
        flip_last_byte((snapshot / "model.safetensors").resolve())
        return snapshot

    with pytest.raises(DataError, match=r"is corrupt: model.safetensors does not match the hash the hub gave;"):
        download(REPO, cache_dir=tmp_path, fetch=corrupting_fetch)
    assert dl.cached_snapshot(REPO, "model", None, tmp_path) is not None  # the files are there ...
    again = download(REPO, cache_dir=tmp_path, fetch=local_fetch(fake_repo))  # ... but never counted complete
    assert again.fetched and again.reason.startswith("no manifest")


def test_git_blob_ids_are_checked_like_the_hub_computes_them(tmp_path):
    snapshot = tmp_path / "models--org--x" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (tmp_path / "blobs").mkdir()
    for name, content, blob in [("good.json", b'{"a": 1}\n', git_hash(b'{"a": 1}\n')),
                                ("bad.json", b'{"a": 2}\n', git_hash(b'{"a": 3}\n'))]:
        (tmp_path / "blobs" / blob).write_bytes(content)
        (snapshot / name).symlink_to(tmp_path / "blobs" / blob)
    with pytest.raises(DataError) as error:
        dl.write_manifest(snapshot)
    assert "bad.json does not match" in str(error.value) and "good.json" not in str(error.value)


def test_resolve_hub_id_finds_the_download_offline(fake_repo, tmp_path):
    snapshot = download(REPO, cache_dir=tmp_path, fetch=local_fetch(fake_repo)).snapshot
    assert resolve_hub_id(REPO, cache_dir=tmp_path) == snapshot
    # the layout is the HF cache's own: transformers finds it by id, with no network
    tokenizer = AutoTokenizer.from_pretrained(REPO, cache_dir=tmp_path, local_files_only=True)
    assert tokenizer.eos_token == "<eos>"
    model = AutoModelForCausalLM.from_pretrained(resolve_hub_id(REPO, cache_dir=tmp_path))
    assert model.config.hidden_size == 32

    (snapshot / "tokenizer.json").unlink()
    with pytest.raises(DataError, match=r"incomplete \(tokenizer.json is missing\).*clustertrain download org/tiny"):
        resolve_hub_id(REPO, cache_dir=tmp_path)


def test_resolve_hub_id_says_how_to_fetch_a_missing_model(tmp_path):
    with pytest.raises(DataError) as error:
        resolve_hub_id("org/absent", cache_dir=tmp_path, revision="v2")
    message = str(error.value)
    assert "model.hub_id 'org/absent' (revision v2) is not in the Hugging Face cache" in message
    assert message.endswith("clustertrain download org/absent --revision v2") and "\n" not in message
    with pytest.raises(DataError, match="is not a Hugging Face id"):
        resolve_hub_id("a/b/c", cache_dir=tmp_path)


def test_hub_fetch_refuses_when_offline(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="HF_HUB_OFFLINE is set, so org/x cannot be downloaded"):
        download("org/x", cache_dir=tmp_path)


def test_cli_prints_the_offline_environment(fake_repo, tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_HUB_CACHE", None)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "clustertrain", "download", *args], env=env,
                              capture_output=True, text=True, timeout=120)

    first = run(REPO, "--from-dir", str(fake_repo))
    assert first.returncode == 0, first.stderr
    assert f"downloaded model {REPO}" in first.stdout
    for line in (f"export HF_HOME={tmp_path / 'hf'}", "export HF_HUB_OFFLINE=1", "export HF_DATASETS_OFFLINE=1",
                 "export TRANSFORMERS_OFFLINE=1", f"model.hub_id: {REPO}"):
        assert line in first.stdout.splitlines() or f"  {line}" in first.stdout.splitlines()
    assert (tmp_path / "hf" / "hub" / "models--org--tiny-llama" / "refs" / "main").is_file()

    second = run(REPO, "--from-dir", str(fake_repo), "--verify")
    assert second.returncode == 0 and second.stdout.startswith("already complete:")
    assert "every file re-hashed and matches" in second.stdout

    dataset = run("org/texts", "--dataset", "--from-dir", str(fake_repo))
    assert "  data.sources: [{hf_name: org/texts}]" in dataset.stdout.splitlines()
    assert (tmp_path / "hf" / "hub" / "datasets--org--texts" / "refs" / "main").is_file()


def test_cli_reports_a_corrupt_file_in_one_line(fake_repo, tmp_path, capsys):
    args = ["download", REPO, "--cache-dir", str(tmp_path), "--from-dir", str(fake_repo)]
    assert main(args) == 0
    flip_last_byte(resolve_hub_id(REPO, cache_dir=tmp_path) / "config.json")
    capsys.readouterr()
    assert main([*args, "--verify"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "config.json has a different sha256" in err
    assert main(["download", REPO, "--from-dir", str(tmp_path / "nowhere")]) == 2
    assert "--from-dir" in capsys.readouterr().err


def test_exclude_fetches_one_weight_format_and_include_narrows_further(fake_repo, tmp_path):
    both = tmp_path / "both-formats"  # a snapshot with the same weights as .bin and .safetensors, like opt-2.7b
    shutil.copytree(fake_repo, both)
    (both / "pytorch_model.bin").write_bytes(b"\0" * 4096)
    (both / "original").mkdir()
    (both / "original" / "consolidated.pth").write_bytes(b"\1" * 1024)
    fetch = CountingFetch(both)

    first = download(REPO, cache_dir=tmp_path / "cache", fetch=fetch, exclude=["*.bin", "original/"])
    assert first.fetched and fetch.calls == 1
    assert repo_files(first.snapshot) == repo_files(fake_repo)  # neither the .bin nor the original/ folder
    assert first.size_bytes == sum((fake_repo / name).stat().st_size for name in repo_files(fake_repo))
    again = download(REPO, cache_dir=tmp_path / "cache", fetch=fetch, exclude=["*.bin", "original/"])
    assert (again.fetched, fetch.calls) == (False, 1)

    only = download("org/configs", cache_dir=tmp_path / "cache", fetch=fetch, include=["*.json"])
    assert repo_files(only.snapshot) == {n for n in repo_files(fake_repo) if n.endswith(".json")}
    whole = download("org/configs", cache_dir=tmp_path / "cache", fetch=fetch)  # other patterns: fetched again
    assert whole.fetched and whole.reason == "the cached copy holds only --include *.json"
    assert repo_files(whole.snapshot) == repo_files(both)
    narrower = download("org/configs", cache_dir=tmp_path / "cache", fetch=fetch, include=["*.json"])
    assert not narrower.fetched  # a whole copy serves any pattern
    assert fetch.calls == 3


def test_cli_downloads_several_ids_and_one_failure_keeps_the_others(fake_repo, tmp_path, capsys):
    cache = str(tmp_path / "cache")
    assert main(["download", "org/a", "org/b", "--cache-dir", cache, "--from-dir", str(fake_repo)]) == 2
    assert "--from-dir copies one directory" in capsys.readouterr().err

    for repo_id in ("org/a", "org/b"):  # in the cache, as a mirror would have staged them
        download(repo_id, cache_dir=cache, fetch=local_fetch(fake_repo))
    code = main(["download", "org/a", "bad id//x", "org/b", "--cache-dir", cache, "--exclude", "*.bin"])
    out, err = capsys.readouterr()
    assert code == 2
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("already complete")] == \
        ["already complete"] * 2
    assert "model org/a (" in out and "model org/b (" in out
    assert "  model.hub_id: org/a" in out.splitlines() and "  model.hub_id: org/b" in out.splitlines()
    assert err.splitlines()[0].startswith("error: 'bad id//x' is not a Hugging Face id")
    assert err.splitlines()[-1] == "error: 1 of 3 downloads failed: bad id//x"
