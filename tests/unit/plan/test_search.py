"""`plan --search` on a world where some layouts cannot deal the config's batch: it skips them, says so in one
line, and refuses only a world where no layout runs the config."""

from __future__ import annotations

import json

import pytest
from helpers import TINY

from clustertrain.cli import main
from clustertrain.launch.presets import load_preset
from clustertrain.plan.search import candidates, search
from clustertrain.plan.target import TargetRequest, target_for
from clustertrain.resolve.load import load_checked_config

FRONTIER_8B = "configs/frontier-llama3-8b.yaml"
SEED_BATCH = 1344  # the Frontier user's 21 sequences of 8,192 on each of 64 data-parallel ranks (seeds/001)


def test_the_seed_s_batch_at_512_ranks_is_searched_on_the_layouts_that_divide_it():
    config = load_checked_config(FRONTIER_8B, [f"train.global_batch_size={SEED_BATCH}"])
    target = target_for(config, TargetRequest(nodes=64, ranks_per_node=8), load_preset("frontier").hardware)
    assert target.world == 512
    tried = candidates(target.config, 512, 8)
    layouts = {(o["parallel"]["tp"], o["parallel"]["pp"]) for o in tried.overrides}
    # tp × pp of 8 or more leaves 64, 32 or 16 data-parallel ranks, each a divisor of 1,344; tp 8 is the seed's
    assert (8, 1) in layouts and all(tp * pp >= 8 for tp, pp in layouts), layouts
    ranked = search(target.config, 512, 8, target.device, keep=1)
    assert ranked.choices and ranked.choices[0].plan.fits
    best = ranked.choices[0].plan.layout
    assert best.global_batch == SEED_BATCH and best.world_size == 512 and SEED_BATCH % best.dp == 0
    assert ranked.skipped.startswith(f"skipped {sum(tried.undivided.values())} layouts: ")
    assert "512, 256 or 128 data-parallel ranks do not divide the global batch of 1,344 sequences" in ranked.skipped


def test_plan_search_names_the_layouts_it_skipped_in_one_line_beside_its_json(capsys):
    # 6 sequences on 4 ranks: tp 1 leaves 4 data-parallel ranks, which do not divide 6; tp 2 and pp 2 leave 2
    code = main(["plan", "--world", "4", "--search", "--json", "--peak-tflops", "1",
                 *[f"--set={o}" for o in (*TINY, "train.global_batch_size=6", "train.micro_batch_size=1")]])
    out, err = capsys.readouterr()
    ranked = json.loads(out)
    assert code == 0 and ranked and all(choice["layout"]["global_batch"] == 6 for choice in ranked)
    assert all(choice["overrides"]["parallel"]["tp"] * choice["overrides"]["parallel"]["pp"] == 2 for choice in ranked)
    said = [line for line in err.splitlines() if line.startswith("plan --search: skipped")]
    assert len(said) == 1 and "whose 4 data-parallel ranks do not divide the global batch of 6 sequences" in said[0]


@pytest.mark.parametrize("argv, says", [
    ([FRONTIER_8B, "--nodes", "64", f"--set=train.global_batch_size={SEED_BATCH - 1}"],
     "error: train.global_batch_size = 1,343 does not divide among the data-parallel ranks of any layout on 512 "
     "ranks (512, 256, 128, 64, 32 or 16); use a multiple of 16 (1,328 or 1,344)"),
    (["--world", "3", *[f"--set={o}" for o in TINY]],  # 8 sequences; on 3 ranks no tp or pp fits a node of 3
     "error: train.global_batch_size = 8 does not divide among the data-parallel ranks of any layout on 3 ranks (3); "
     "use a multiple of 3 (6 or 9)"),
], ids=["seed batch less one at 512 ranks", "8 sequences on 3 ranks"])
def test_a_batch_no_layout_of_the_world_divides_is_refused_in_one_line(capsys, argv, says):
    assert main(["plan", *argv, "--search"]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
