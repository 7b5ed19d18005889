"""Reading checkpoints without trusting them: the metadata allowlist, refused payloads, damage, shapes."""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from clustertrain.checkpoint import dcp as ckpt
from clustertrain.checkpoint.load import load_checkpoint
from clustertrain.checkpoint.train_state import TrainState
from clustertrain.checkpoint.reader import (METADATA_GLOBALS, DamagedCheckpoint, MetadataUnpickler, check_fits,
                                            load_state, open_checkpoint, read_metadata)
from clustertrain.errors import CheckpointError


class OpenPayload:
    """Creates `marker` when unpickled by plain pickle: what an attacker would put in a checkpoint."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


class SystemPayload(OpenPayload):
    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class ExecPayload(OpenPayload):
    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w')",)


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def saved(one_rank, tmp_path):
    """A real clustertrain checkpoint of an FSDP-sharded (DTensor) model with AdamW state, in a bf16 and an
    fp32 part, saved and committed as training does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4).to(torch.bfloat16))
    mesh = init_device_mesh("cpu", (1,))
    for layer in model:  # one FSDP group per dtype
        fully_shard(layer, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model[1](model[0](torch.randn(2, 8)).bfloat16()).float().sum().backward()
    optimizer.step()
    root = tmp_path / "checkpoints"
    ckpt.write_shards(root, 2, model, optimizer)
    ckpt.commit(root, 2, TrainState(step=2, tokens_seen=64, world_size=1), lambda folder: None)
    return root / "step-0000002", model, optimizer


def globals_referenced(file) -> set[tuple[str, str]]:
    found = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            found.add((module, name))
            return super().find_class(module, name)

    with open(file, "rb") as f:
        Recorder(f).load()
    return found


def test_the_allowlist_admits_everything_a_real_checkpoints_metadata_uses(saved):
    path = saved[0]
    used = globals_referenced(path / ".metadata")
    dtypes = {("torch", "float32"), ("torch", "bfloat16")}
    assert used - dtypes <= set(METADATA_GLOBALS), used - dtypes - set(METADATA_GLOBALS)
    assert dtypes <= used
    with open(path / ".metadata", "rb") as f:
        expected = pickle.load(f)  # our own fresh file: safe to read the unsafe way, for comparison
    metadata = read_metadata(path)
    assert metadata.state_dict_metadata == expected.state_dict_metadata
    assert metadata.storage_data == expected.storage_data


def test_a_checkpoint_read_through_the_allowlist_loads_as_before(saved):
    path, model, optimizer = saved
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert load_checkpoint(path, model, optimizer).step == 2
    for k, v in model.state_dict().items():
        assert torch.equal(v.full_tensor(), before[k]), k


@pytest.mark.parametrize("payload", [OpenPayload, SystemPayload, ExecPayload])
def test_a_payload_in_metadata_is_refused_without_running(saved, tmp_path, payload):
    marker = tmp_path / "marker"
    (saved[0] / ".metadata").write_bytes(pickle.dumps(payload(marker)))
    with pytest.raises(DamagedCheckpoint) as error:
        read_metadata(saved[0])
    message = str(error.value)
    assert message.startswith(f"{saved[0] / '.metadata'} holds code or non-tensor objects (it refers to ")
    assert message.endswith("and was not loaded") and "\n" not in message
    assert not marker.exists()


def test_a_payload_hidden_inside_real_metadata_is_refused(saved, tmp_path):
    marker = tmp_path / "marker"
    metadata = read_metadata(saved[0])
    metadata.planner_data = {"model.0.weight": OpenPayload(marker)}
    (saved[0] / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(DamagedCheckpoint, match="holds code"):
        open_checkpoint(saved[0])
    assert not marker.exists()


@pytest.mark.parametrize("module, name", [
    ("torch", "load"), ("torch", "save"), ("torch.serialization", "load"), ("builtins", "eval"),
    ("torch.distributed.checkpoint.metadata", "torch"), ("pathlib", "Path.write_text"), ("posix", "system"),
])
def test_globals_outside_the_allowlist_are_refused(module, name):
    data = f"c{module}\n{name}\n.".encode()  # protocol 0: GLOBAL then STOP
    with pytest.raises(pickle.UnpicklingError, match=f"{module}.{name}"):
        MetadataUnpickler(io.BytesIO(data)).load()


@pytest.mark.parametrize("attribute", ["evil", "__eq__"])
def test_a_pickle_that_changes_an_admitted_class_is_refused_and_undone(attribute):
    # GLOBAL Metadata, then BUILD on the class itself with slot state {attribute: 1}: plain pickle would setattr
    data = (b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\nN}X" + len(attribute).to_bytes(4, "little")
            + attribute.encode() + b"K\x01s\x86b.")
    original = vars(Metadata).get(attribute)
    with pytest.raises(pickle.UnpicklingError, match="it changes the class torch.distributed.checkpoint.metadata.Meta"):
        MetadataUnpickler(io.BytesIO(data)).load()
    assert vars(Metadata).get(attribute) is original


def test_dtypes_and_paths_pickled_by_other_python_versions_are_admitted():
    assert MetadataUnpickler(io.BytesIO(b"ctorch\nfloat16\n.")).load() is torch.float16
    path = MetadataUnpickler(io.BytesIO(b"cpathlib._local\nPosixPath\n(S'/runs/a'\ntR.")).load()
    assert str(path) == "/runs/a"


@pytest.mark.parametrize("content, message", [
    (None, r"\.metadata is missing"),
    (b"\x80\x04\x95", r"\.metadata is damaged \("),
    (pickle.dumps({"state_dict_metadata": {}}), "not torch.distributed.checkpoint metadata"),
])
def test_missing_or_damaged_metadata_is_one_line(saved, content, message):
    file = saved[0] / ".metadata"
    if content is None:
        file.unlink()
    else:
        file.write_bytes(content)
    with pytest.raises(DamagedCheckpoint, match=message) as error:
        open_checkpoint(saved[0])
    assert "\n" not in str(error.value)


def shard_of(path, prefix="model."):
    """(shard file, offset, length) of the first stored item whose key starts with `prefix`."""
    for index, info in read_metadata(path).storage_data.items():
        if index.fqn.startswith(prefix):
            return path / info.relative_path, info.offset, info.length
    raise AssertionError(prefix)


@pytest.mark.parametrize("prefix", ["model.", "optim.param_groups"])
def test_a_payload_in_a_shard_is_refused_naming_the_file(saved, tmp_path, prefix):
    path, model, optimizer = saved
    marker = tmp_path / "marker"
    file, offset, length = shard_of(path, prefix)
    payload = pickle.dumps(OpenPayload(marker), protocol=2)  # protocol 4 is refused sooner, for its FRAME opcode
    assert len(payload) <= length
    with open(file, "r+b") as f:
        f.seek(offset)
        f.write(payload)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, model, optimizer)
    assert str(error.value) == f"{file} holds code or non-tensor objects (it refers to io.open) and was not loaded"
    assert not marker.exists()


def test_shard_damage_is_found_before_loading(saved):
    path, model, optimizer = saved
    file, _, _ = shard_of(path)
    with open(file, "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match=f"^{file} is truncated \\(10 bytes, \\d+ expected\\)$"):
        load_checkpoint(path, model, optimizer)
    file.unlink()
    with pytest.raises(CheckpointError, match=f"^{file} is missing$"):
        load_checkpoint(path, model, optimizer)


@pytest.mark.parametrize("state, message", [
    ({"step": "2", "tokens_seen": 64}, "step is '2', not a count"),
    ({"step": 2.5, "tokens_seen": 64}, "step is 2.5, not a count"),
    ({"step": True, "tokens_seen": 64}, "step is True, not a count"),
    ({"step": 2}, "tokens_seen is None, not a count"),
    ({"step": 2, "tokens_seen": 64, "world_size": "2"}, "world_size is '2', not a count"),
    ([2], "step is None, not a count"),
])
def test_a_train_state_without_integer_counts_is_one_line(saved, state, message):
    (saved[0] / "train_state.json").write_text(json.dumps(state))
    with pytest.raises(DamagedCheckpoint, match=f"train_state.json: {message}$"):
        open_checkpoint(saved[0])


@pytest.mark.parametrize("content, message", [
    (None, "rng-0.json is missing"), ("{not json", r"rng-0.json is damaged \(not JSON"),
    ('{"python": 1}', r"rng-0.json is damaged \(not an RNG state\)"),
    ('{"python": 1, "numpy": 2, "torch": 3, "cuda": []}', r"rng-0.json is damaged \(not an RNG state: TypeError\)"),
])
def test_a_damaged_rng_state_is_one_line(saved, content, message):
    path, model, optimizer = saved
    if content is None:
        (path / "rng-0.json").unlink()
    else:
        (path / "rng-0.json").write_text(content)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, model, optimizer)


def test_a_damaged_newest_checkpoint_names_the_previous_intact_one(saved):
    path, model, optimizer = saved
    root = path.parent
    older, oldest = root / "step-0000001", root / "step-0000000"
    shutil.copytree(path, older)
    shutil.copytree(path, oldest)
    (older / "rng-0.json").unlink()  # damaged too: the hint skips it
    (path / ".metadata").unlink()
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, model, optimizer)
    assert str(error.value).endswith(f"; to go on from the previous intact checkpoint: --resume {oldest}")
    shutil.rmtree(oldest)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, model, optimizer)
    assert str(error.value) == f"{path / '.metadata'} is missing, so the checkpoint's shards cannot be read"


def test_shapes_that_differ_from_the_checkpoint_are_named_before_loading(saved):
    path = saved[0]
    metadata = read_metadata(path)
    good = {"model": {"0.weight": torch.zeros(16, 8), "0.bias": torch.zeros(16), "1.weight": torch.zeros(4, 16),
                      "1.bias": torch.zeros(4)}}
    check_fits(path, metadata, good)
    wider = {"model": {**good["model"], "1.weight": torch.zeros(4, 17)}}
    with pytest.raises(CheckpointError, match=r": 1\.weight is \(4, 16\) in the checkpoint but \(4, 17\) in this "):
        check_fits(path, metadata, wider)
    larger = {"model": {**good["model"], "2.weight": torch.zeros(3)}}
    with pytest.raises(CheckpointError, match=r": the checkpoint has no 2\.weight \(3,\), which this run has"):
        check_fits(path, metadata, larger)
    smaller = {"model": {k: v for k, v in good["model"].items() if not k.startswith("1.")}}
    with pytest.raises(CheckpointError, match=r": the checkpoint holds 1\.(weight \(4, 16\)|bias \(4,\)), which "):
        check_fits(path, metadata, smaller)
    state = {"optim": {"state": {"0.weight": {"exp_avg": torch.zeros(16, 9)}}}}
    with pytest.raises(CheckpointError, match=r"optimizer state 0\.weight\.exp_avg is \(16, 8\) in the checkpoint"):
        check_fits(path, metadata, state)


def test_load_state_refuses_a_payload_without_a_process_group(tmp_path):
    folder = tmp_path / "ckpt"
    dcp.save({"model": {"w": torch.ones(64)}, "extra": {"note": "plain data"}}, checkpoint_id=folder, no_dist=True)
    index = next(i for i in read_metadata(folder).storage_data if i.fqn == "extra.note")
    info = read_metadata(folder).storage_data[index]
    marker = tmp_path / "marker"
    payload = pickle.dumps(OpenPayload(marker))
    shard = folder / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset:info.offset + info.length] = payload.ljust(info.length, b"\0")
    shard.write_bytes(bytes(data))
    state = {"model": {"w": torch.zeros(64)}, "extra": {"note": ""}}
    with pytest.raises(DamagedCheckpoint, match="holds code"):
        load_state(state, folder, read_metadata(folder))
    assert not marker.exists()
    assert isinstance(read_metadata(folder), Metadata)
    assert "posix" not in " ".join(str(op) for op in pickletools.genops((folder / ".metadata").read_bytes()))


def test_import_of_a_pytorch_model_bin_with_a_payload_is_one_line(tmp_path):
    from transformers import LlamaConfig

    from clustertrain.checkpoint.export import import_hf

    marker, hf_dir = tmp_path / "marker", tmp_path / "hf"
    LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(hf_dir)
    torch.save(OpenPayload(marker), hf_dir / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as error:
        import_hf(hf_dir, tmp_path / "ckpt")
    assert str(error.value) == (f"{hf_dir / 'pytorch_model.bin'} holds code or non-tensor objects (it refers to "
                                "io.open) and was not loaded")
    assert not marker.exists() and not (tmp_path / "ckpt").exists()
