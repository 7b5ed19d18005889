from __future__ import annotations

import pytest

from clustertrain.config.schema import OptimConfig
from clustertrain.train.optim import lr_at


def test_warmup_then_cosine_to_the_floor():
    optim = OptimConfig(lr=1.0, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert lr_at(0, 110, optim) == pytest.approx(0.1)
    assert lr_at(9, 110, optim) == pytest.approx(1.0)
    assert lr_at(60, 110, optim) == pytest.approx(0.55)
    assert lr_at(110, 110, optim) == pytest.approx(0.1)


@pytest.mark.parametrize(("schedule", "middle"), [("linear", 0.55), ("constant", 1.0)])
def test_linear_and_constant(schedule, middle):
    optim = OptimConfig(lr=1.0, warmup_steps=10, schedule=schedule, min_lr_ratio=0.1)
    assert lr_at(60, 110, optim) == pytest.approx(middle)


def test_token_budget_sets_the_step_count():
    from clustertrain.config.load import load_config
    from clustertrain.train.trainer import total_steps

    config = load_config(None, ["train.tokens=100000", "train.global_batch_size=16", "data.seq_len=128"])
    assert total_steps(config) == 49  # ceil(100000 / 2048)
    assert total_steps(load_config(None, ["train.steps=7"])) == 7


def test_adamw_kernel_is_fused_where_torch_has_one():
    import torch

    from clustertrain.errors import ConfigError
    from clustertrain.train.optim import adamw_kernel

    cpu = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))]
    assert adamw_kernel(cpu, "auto") == {"fused": True}  # CPU's fused AdamW, torch >= 2.4
    assert adamw_kernel(cpu, "foreach") == {"foreach": True}
    assert adamw_kernel(cpu, "auto", loss_scaling=True) == {"foreach": True}  # float16's sharded scaler
    with pytest.raises(ConfigError, match="does not work with parallel.param_dtype = float16"):
        adamw_kernel(cpu, "fused", loss_scaling=True)
    meta = [torch.nn.Parameter(torch.ones(2, device="meta"))]
    assert adamw_kernel(meta, "auto") == {"foreach": True}
    with pytest.raises(ConfigError, match=r"optim.implementation = 'fused': .* on \['meta'\]; use auto or foreach"):
        adamw_kernel(meta, "fused")
