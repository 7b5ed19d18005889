"""A scaling study's configs (one per node count, the same global batch) and its report (table, efficiency, PNG),
from metrics files as the trainer writes them; tests/slurm/test_scaling_study.py runs the jobs under the real Slurm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clustertrain.cli import main
from clustertrain.config.load import load_config
from clustertrain.errors import ConfigError, LaunchError
from clustertrain.launch.scaling import format_table, parse_counts, read_scaling, scaling_configs


def test_node_counts_are_parsed_sorted_and_once():
    assert parse_counts("4,1,2,2, 8") == [1, 2, 4, 8]
    for bad in ("", "1,x", "0,2", "-1"):
        with pytest.raises(ConfigError, match="--scaling"):
            parse_counts(bad)


def test_each_count_gets_its_own_run_dir_and_the_same_global_batch(tmp_path):
    config = load_config(None, ["train.run_dir=runs/study", "name=study", "slurm.tasks_per_node=2",
                                "train.micro_batch_size=2", "train.grad_accum=3", "train.epochs=1"])
    configs = scaling_configs(config, [1, 2, 4], steps=20, workdir=tmp_path)
    assert list(configs) == [1, 2, 4]
    for nodes, each in configs.items():
        assert each.slurm.nodes == nodes and each.name == f"study-N{nodes}"
        assert each.train.run_dir == str(tmp_path / "runs" / "study" / f"scaling-N{nodes}")
        # 2 x 3 per rank on the 8 ranks of the largest count, pinned: every count does the same work per step
        assert (each.train.global_batch_size, each.train.grad_accum) == (2 * 3 * 8, None)
        assert (each.train.steps, each.train.epochs) == (20, None)
    assert config.slurm.nodes == 1 and config.train.grad_accum == 3  # the caller's config is left as it was


def test_counts_that_do_not_fit_are_all_named(tmp_path):
    config = load_config(None, ["train.global_batch_size=6", "train.micro_batch_size=1"])
    with pytest.raises(ConfigError) as error:
        scaling_configs(config, [1, 2, 4, 5], steps=None, workdir=tmp_path)
    message = str(error.value)
    assert "4 node(s): train.global_batch_size = 6 is not divisible by the 4" in message
    assert "5 node(s)" in message and "2 node(s)" not in message


def write_metrics(run_dir: Path, ranks: int, rates: list[float], tokens_per_step: int = 1000) -> None:
    """metrics.jsonl as the trainer logs it every 2 steps: tokens so far, tokens/s of the interval, per rank."""
    run_dir.mkdir(parents=True)
    lines = [{"step": 0, "load_mem_gb": 0.4}]
    for i, rate in enumerate(rates):
        step = 1 if i == 0 else 2 * i
        lines.append({"step": step, "loss": 5.0 - i / 10, "tokens_per_s": rate, "tokens_per_s_per_rank": rate / ranks,
                      "tokens": step * tokens_per_step})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_the_report_measures_after_the_warmup_and_compares_per_node(tmp_path):
    write_metrics(tmp_path / "scaling-N1", ranks=2, rates=[100, 500, 1000, 1000, 1000, 1000])
    write_metrics(tmp_path / "scaling-N2", ranks=4, rates=[100, 900, 1500, 1500, 2500, 1500])
    write_metrics(tmp_path / "scaling-N4", ranks=8, rates=[50])  # still in its warm-up
    rows = read_scaling(tmp_path, warmup_steps=4)
    assert [(r.nodes, r.ranks, r.steps) for r in rows] == [(1, 2, 6), (2, 4, 6), (4, 8, 0)]
    assert rows[0].tokens_per_s == pytest.approx(1000)  # the slow first intervals are left out
    # intervals of 2000 tokens at 1500, 2500 and 1500 tokens/s: 6000 tokens in 1.333 + 0.8 + 1.333 s
    assert rows[1].tokens_per_s == pytest.approx(6000 / (4000 / 1500 + 2000 / 2500))
    assert rows[1].efficiency == pytest.approx(rows[1].tokens_per_s / 2 / 1000)
    assert (rows[2].tokens_per_s, rows[2].efficiency) == (None, None)
    table = format_table(rows).splitlines()
    assert table[0].split() == ["nodes", "ranks", "steps", "tokens/s", "tokens/s/node", "efficiency"]
    assert table[1].split() == ["1", "2", "6", "1,000", "1,000", "100%"]
    assert table[2].split()[-1] == "87%" and table[3].endswith("not measured yet")


def test_the_scaling_command_prints_the_table_and_writes_a_png(tmp_path, capsys):
    plt = pytest.importorskip("matplotlib.pyplot")
    write_metrics(tmp_path / "scaling-N1", ranks=1, rates=[100, 1000, 1000, 1000, 1000])
    write_metrics(tmp_path / "scaling-N2", ranks=2, rates=[100, 1800, 1800, 1800, 1800])
    assert main(["slurm", "scaling", str(tmp_path), "--warmup-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2].split()[-1] == "90%" and f"wrote {tmp_path / 'scaling.png'}" in out
    image = plt.imread(tmp_path / "scaling.png")
    assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0  # a drawn picture, not a blank

    with pytest.raises(LaunchError, match="no scaling-N<nodes> runs"):
        read_scaling(tmp_path / "scaling-N1")
    assert main(["slurm", "scaling", str(tmp_path), "--warmup-steps", "100"]) == 2
    assert "lower --warmup-steps" in capsys.readouterr().err
