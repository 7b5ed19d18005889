"""Schema validators: values that cannot train are config errors (exit 2, one line), not a NaN run."""

from __future__ import annotations

import pytest

from clustertrain.config.load import load_config
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
