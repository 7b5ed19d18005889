"""A save stopped after any one of its writes leaves no published checkpoint that a resume cannot read, and the
checkpoint before it intact.

In-process, one rank: the trainer's own save, stopped (as a kill would stop it) after each write in turn through
`clustertrain.checkpoint.dcp.after_write`. Every `step-N` folder left is then resumed from as `Trainer.resume`
reads it: the train state, each rank's RNG file, DCP's metadata and every shard, the data position; and it holds
the config and tokenizer that export and generate read.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import TINY

from clustertrain.checkpoint import dcp as ckpt
from clustertrain.checkpoint.load import load_checkpoint
from clustertrain.checkpoint.train_state import TRAIN_STATE
from clustertrain.config.load import load_config
from clustertrain.train.trainer import Trainer


class Killed(BaseException):
    """Stops a save where it is: the save's handlers catch Exception (a failed write), never this."""


def stop_after(count: int):
    """An `after_write` that stops the save after its `count`-th write."""
    writes = []

    def after_write(written: str) -> None:
        writes.append(written)
        if len(writes) == count:
            raise Killed(written)
    return after_write


def published(root: Path) -> list[Path]:
    """Every folder named like a checkpoint, complete or not: what a user, or `--resume PATH`, would pick."""
    return sorted(p for p in root.iterdir() if ckpt.STEP_DIR.match(p.name))


def resume_from(trainer: Trainer, folder: Path) -> int:
    """Load `folder` as a resume does (into the trainer's model, optimizer and loader); its step."""
    state = load_checkpoint(folder, trainer.model.runner.parts, trainer.optim.optimizer)
    trainer.data.loader.load_state_dict(state.data)
    assert (folder / "config.yaml").is_file() and (folder / "tokenizer" / "tokenizer.json").is_file(), folder
    return state.step


def test_a_save_stopped_after_any_write_publishes_nothing_incomplete(tmp_path, monkeypatch):
    config = load_config(None, [*TINY, f"train.run_dir={tmp_path}", "train.steps=20", "train.sample_tokens=0",
                                "checkpoint.keep_last=null"])
    root = tmp_path / "checkpoints"
    trainer = Trainer(config)
    try:
        trainer.build()
        trainer.start(None)
        trainer.train_steps(1)
        written: list[str] = []
        monkeypatch.setattr(ckpt, "after_write", written.append)
        trainer.save(wait=True)  # step 1, whole: every stop below must leave it as it is
        assert written == ["rng-0.json", "shards and .metadata", "config.yaml and tokenizer", TRAIN_STATE,
                           "step-0000001"]
        for count, name in enumerate(written, start=1):
            trainer.train_steps(1)
            monkeypatch.setattr(ckpt, "after_write", stop_after(count))
            with pytest.raises(Killed):
                trainer.save(wait=True)
            monkeypatch.setattr(ckpt, "after_write", lambda written: None)
            folders = published(root)
            assert folders[0].name == "step-0000001", f"stopped after {name}: the earlier checkpoint is gone"
            assert [resume_from(trainer, folder) for folder in folders] == [
                int(folder.name.split("-")[1]) for folder in folders], f"stopped after {name}"
            ckpt.remove_incomplete(root)  # what the next start does first: a save with its train state is whole
            complete = count >= written.index(TRAIN_STATE) + 1
            assert ckpt.latest_checkpoint(root) == (root / ckpt.step_dir_name(trainer.step) if complete
                                                    else folders[-1]), f"stopped after {name}"
        # the same step saved again (as after a resume from an earlier checkpoint), stopped once the old folder is
        # moved aside: the new one, complete, is published at the next start
        monkeypatch.setattr(ckpt, "after_write", stop_after(len(written)))
        with pytest.raises(Killed, match=".trash-"):
            trainer.save(wait=True)
        monkeypatch.setattr(ckpt, "after_write", lambda written: None)
        assert published(root)[-1].name != ckpt.step_dir_name(trainer.step)
        ckpt.remove_incomplete(root)
        assert resume_from(trainer, ckpt.latest_checkpoint(root)) == trainer.step
        assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []
    finally:
        trainer.close()
