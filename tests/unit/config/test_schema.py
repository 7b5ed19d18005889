"""Schema validators: values that cannot train are config errors (exit 2, one line), not a NaN run."""

from __future__ import annotations

import math

import pytest

from clustertrain.config.load import load_config
from clustertrain.config.slurm_schema import parse_slurm_time, walltime_seconds
from clustertrain.errors import ConfigError


@pytest.mark.parametrize(("override", "message"), [
    ("optim.lr=.inf", "optim.lr = inf: Input should be a finite number"),
    ("optim.lr=nan", "optim.lr = 'nan': Input should be a finite number"),
    ("optim.lr=0", "optim.lr = 0: Input should be greater than 0"),
    ("optim.betas=[1.5, -1]", "optim.betas.0 = 1.5: Input should be less than 1"),
    ("optim.betas=[0.9, 1]", "optim.betas.1 = 1: Input should be less than 1"),
    ("optim.betas=[-0.1, 0.9]", "optim.betas.0 = -0.1: Input should be greater than or equal to 0"),
    ("optim.eps=.inf", "optim.eps = inf: Input should be a finite number"),
    ("optim.weight_decay=.nan", "optim.weight_decay = nan: Input should be a finite number"),
    ("train.on_nan=ignore", "train.on_nan = 'ignore': Input should be 'stop' or 'skip'"),
])
def test_optimizer_values_that_cannot_train_are_config_errors(override, message):
    with pytest.raises(ConfigError, match="config error") as error:
        load_config(None, [override])
    assert message in str(error.value)


def test_both_betas_are_named_at_once():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["optim.betas=[1.5, -1]"])
    assert "optim.betas.1 = -1: Input should be greater than or equal to 0" in str(error.value)


@pytest.mark.parametrize("override", ["optim.betas=[0, 0.999]", "optim.lr=1e4", "train.on_nan=skip"])
def test_values_at_the_edges_are_accepted(override):
    load_config(None, [override])


# ---- time limits: one parser (Slurm's rule) for slurm.time and train.walltime --------------------------------
SLURM_FORMS = [  # (text, seconds): every form sbatch --time takes
    ("90", 90 * 60),  # MM: a bare number is minutes
    ("5", 5 * 60),
    ("90:30", 90 * 60 + 30),  # MM:SS
    ("0:45", 45),
    ("02:00:00", 2 * 3600),  # HH:MM:SS
    ("36:00:00", 36 * 3600),  # the leading field takes any size, as in Slurm
    ("1:02:03", 3600 + 2 * 60 + 3),
    ("1-02", 86400 + 2 * 3600),  # D-HH
    ("2-0", 2 * 86400),
    ("1-02:30", 86400 + 2 * 3600 + 30 * 60),  # D-HH:MM
    ("1-02:30:15", 86400 + 2 * 3600 + 30 * 60 + 15),  # D-HH:MM:SS
    ("0-00:00:01", 1),
    ("UNLIMITED", math.inf),
    ("infinite", math.inf),
    ("0", math.inf),  # a limit of zero: no limit, as in Slurm
    ("00:00:00", math.inf),
]
BAD_FORMS = ["", "ten", "1:2:3:4", "1-2:3:4:5", "1-", "-5", "-1", "1--2", "1-2-3", "1.5", "1:30.5", "01:30:", ":30",
             "1-:30", "1 h", " 90", "90 ", "+5", "0x10", "\u0663", "1h30m", "never"]


@pytest.mark.parametrize(("text", "seconds"), SLURM_FORMS, ids=[t or "empty" for t, _ in SLURM_FORMS])
def test_every_slurm_time_form_is_read_by_slurms_rule(text, seconds):
    assert parse_slurm_time(text) == seconds
    assert walltime_seconds(text) == seconds  # train.walltime's text: the same parser


@pytest.mark.parametrize("text", BAD_FORMS, ids=[repr(t) for t in BAD_FORMS])
def test_a_bad_slurm_time_is_one_line_naming_the_forms(text):
    with pytest.raises(ValueError) as error:
        parse_slurm_time(text)
    assert str(error.value) == ("not a Slurm time: use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS "
                                "(e.g. 90, 02:00:00, 1-12), or UNLIMITED")


@pytest.mark.parametrize(("override", "seconds"), [
    ("1:30", 90),  # YAML 1.1 would read 1:30 as the integer 90 (90 minutes for slurm.time): kept as text
    ("2:00:00", 7200),  # and this as 7200
    ("'90'", 5400),
    ("00:10:00", 600),
    ("1-02", 93600),
    ("UNLIMITED", math.inf),
])
def test_slurm_time_and_walltime_agree_on_every_override(override, seconds):
    config = load_config(None, [f"slurm.time={override}", "slurm.signal_before=10", f"train.walltime={override}"])
    assert parse_slurm_time(config.slurm.time) == seconds
    assert config.walltime_s == seconds


def test_a_number_is_minutes_for_slurm_time_and_seconds_for_walltime():
    config = load_config(None, ["slurm.time=90", "train.walltime=90"])
    assert config.slurm.time == "90" and parse_slurm_time(config.slurm.time) == 5400  # as sbatch --time=90
    assert config.walltime_s == 90.0
    assert load_config(None, ["train.walltime=12.5"]).walltime_s == 12.5
    assert load_config(None, []).walltime_s is None


def test_times_in_config_files_keep_their_meaning(tmp_path):
    (tmp_path / "run.yaml").write_text("slurm:\n  time: 2:00:00\ntrain:\n  walltime: 1:30\n")
    yaml_config = load_config(tmp_path / "run.yaml")
    assert (yaml_config.slurm.time, yaml_config.walltime_s) == ("2:00:00", 90)
    (tmp_path / "run.toml").write_text("[slurm]\ntime = 02:00:00\n[train]\nwalltime = 01:30:00\n")  # TOML times of day
    toml_config = load_config(tmp_path / "run.toml")
    assert (toml_config.slurm.time, toml_config.walltime_s) == ("02:00:00", 5400)


@pytest.mark.parametrize(("override", "message"), [
    ("slurm.time=soon", "slurm.time = 'soon': not a Slurm time: use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                        "D-HH:MM:SS"),
    ("slurm.time=1-02:03:04:05", "slurm.time = '1-02:03:04:05': not a Slurm time"),
    ("train.walltime=soon", "train.walltime = 'soon': not a Slurm time"),
    ("train.walltime=1.5:00", "train.walltime = '1.5:00': not a Slurm time"),
    ("train.walltime=-5", "train.walltime = -5: not a time limit: give seconds (at least 0)"),
    ("train.walltime=.nan", "train.walltime = nan: not a time limit"),
    ("slurm.time=0:30", "signal_before = 300 s must be shorter than time = '0:30'"),
])
def test_bad_time_limits_are_one_line_config_errors(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
