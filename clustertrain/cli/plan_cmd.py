"""`clustertrain plan CONFIG`: memory per rank, step time and communication of a layout, before submitting it.

    clustertrain plan configs/frontier-llama3-8b.yaml --nodes 64                 # the preset of its slurm section
    clustertrain plan configs/frontier-llama3-8b.yaml --nodes 640 --set parallel.tp=8 --json
    clustertrain plan configs/tiny-llama.yaml --world 4 --preset h100 --device-memory 40
    clustertrain plan configs/opt-pp-lora-cpu.yaml --nodes 40                    # CPU nodes: slurm.tasks_per_node
    clustertrain plan configs/frontier-llama3-8b.yaml --nodes 64 --search --plot plan.png    # the best layouts
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from clustertrain.errors import UserError

# Each numeric flag of `plan`: its flag, the least and the most it may be (the least excluded for a float), and what
# it is. argparse's int and float take "-1", "nan" and "inf"; a plan of them prints nonsense (MFU 500%, nan s).
NUMBERS = {
    "world": ("--world", 1, None, "ranks"), "nodes": ("--nodes", 1, None, "nodes"),
    "gpus_per_node": ("--gpus-per-node", 1, None, "ranks per node"),
    "device_memory": ("--device-memory", 0.0, 1e6, "GB of device memory per rank"),
    "peak_tflops": ("--peak-tflops", 0.0, 1e6, "TFLOP/s of the device's peak"),
    "efficiency": ("--efficiency", 0.0, 1.0, "the fraction of the peak FLOP/s the matmuls reach"),
}


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plan", help="memory per rank, step time and communication of the config's layout at any world size, "
        "computed on this CPU (a fake process group; no GPU, no cluster)")
    parser.add_argument("config", nargs="?", help="YAML or TOML config; omit for the embedded default")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--world", type=int, metavar="N", help="ranks in all (default: the config's slurm.nodes)")
    size.add_argument("--nodes", type=int, metavar="N", help="nodes, each with --gpus-per-node ranks")
    parser.add_argument("--gpus-per-node", type=int, metavar="G", help="ranks per node (default: "
                        "slurm.tasks_per_node, else the GPUs per node of the config or its preset, else 1 on CPU nodes)")
    parser.add_argument("--preset", metavar="NAME", help="the hardware: a preset with a hardware section "
                        "(frontier, perlmutter, h100, a100, or a file; default: the config's slurm.preset)")
    parser.add_argument("--device-memory", type=float, metavar="GB", help="device memory per rank, GB (above 0)")
    parser.add_argument("--peak-tflops", type=float, metavar="T",
                        help="the device's peak at the compute dtype (above 0)")
    parser.add_argument("--efficiency", type=float, metavar="F", help="fraction of peak FLOP/s the matmuls reach, "
                        "above 0 and at most 1 (default: the device's published MFU in the hardware catalogue, "
                        "e.g. 0.40 on an H100 or an MI250X GCD; 0.5 for a device with none)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. parallel.tp=8")
    parser.add_argument("--search", action="store_true", help="try the layouts that could train this config on this "
                        "world (strategy, tp, pp, micro batch, activation checkpointing) and rank those that fit")
    parser.add_argument("--plot", metavar="PNG", help="draw memory per rank by component and step time by part "
                        "(the plan, or the best layouts of --search)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (bytes, seconds)")
    parser.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from clustertrain.launch.presets import load_preset
    from clustertrain.plan.plan import make_plan, without_sequence_parallel
    from clustertrain.plan.target import TargetRequest, target_for
    from clustertrain.resolve.load import load_checked_config
    from clustertrain.resolve.run import resolve

    check_numbers(args)
    config = load_checked_config(args.config, args.set)
    preset = load_preset(args.preset or config.slurm.preset)
    request = TargetRequest(world=args.world, nodes=args.nodes, ranks_per_node=ranks_per_node(args, config, preset),
                            device_memory_gb=args.device_memory, peak_tflops=args.peak_tflops,
                            efficiency=args.efficiency)
    target = target_for(config, request, preset.hardware)
    name = f"{args.config or 'the default config'} on {target.where}"
    if args.search:
        return _search(args, target, name)
    run = resolve(target.config, target.world, target.device.per_node, target.device_type)
    plan = make_plan(run.config, run.layout, target.device.per_node, target.device)
    if run.choice:
        print(run.choice.line)
    cost = without_sequence_parallel(plan)
    if cost:
        print(cost, file=sys.stderr)
    if args.plot:
        from clustertrain.plan.picture import draw

        draw([("this layout", plan)], args.plot, name)
    if args.json:
        print(json.dumps(plan.to_json(), indent=1))
    else:
        print(f"plan: {name}")
        print(plan_table(plan))
    return 0 if plan.fits else 1


def ranks_per_node(args: argparse.Namespace, config, preset) -> int | None:
    """--gpus-per-node, else the ranks per node of the config's slurm section and preset as `config check --nodes`
    reads them (slurm.tasks_per_node, else one rank per GPU, else 1 on a CPU node). With --world, only what those
    state: None (the whole world on one node, as `train --nproc N` runs it) where they state nothing."""
    from clustertrain.launch.slurm import job_spec

    if args.gpus_per_node is not None:
        return args.gpus_per_node
    slurm = config.slurm
    if args.world is not None and not (slurm.tasks_per_node or slurm.gpus_per_node or preset.gpus_per_node):
        return None
    return job_spec(slurm, preset).tasks_per_node


def check_numbers(args: argparse.Namespace) -> None:
    """Every numeric flag given is a finite number in its range (NUMBERS).

    Raises:
        UserError: One line naming the first flag that is not, and its range.
    """
    for dest, (flag, low, high, what) in NUMBERS.items():
        value = getattr(args, dest)
        if value is None:
            continue
        if isinstance(low, int):
            if value < low:
                raise UserError(f"plan: {flag} is {value}; it must be at least {low} ({what})")
        elif not (math.isfinite(value) and low < value <= high):
            raise UserError(f"plan: {flag} is {value}; it must be above {low:g} and at most {high:,.0f} ({what})")


def _search(args: argparse.Namespace, target, name: str) -> int:
    from clustertrain.plan.search import search

    searched = search(target.config, target.world, target.device.per_node, target.device)
    ranked = searched.choices
    if args.plot and ranked:
        from clustertrain.plan.picture import draw

        draw([(f"#{i + 1}", choice.plan) for i, choice in enumerate(ranked)], args.plot, name)
    if args.json:
        print(json.dumps([{"overrides": c.overrides, **c.plan.to_json()} for c in ranked], indent=1))
    elif not ranked:
        print(f"plan --search: {name}: no layout fits")
    else:
        print(f"plan --search: {name}: {len(ranked)} layouts that fit, fastest first")
        for i, choice in enumerate(ranked):
            print(f"  #{i + 1} {choice.describe()}")
        print(f"\nthe best, #1:\n{plan_table(ranked[0].plan)}")
    if searched.skipped:  # on stderr under --json, which keeps stdout one JSON document
        print(f"plan --search: {searched.skipped}", file=sys.stderr if args.json else sys.stdout)
    return 0 if ranked else 1


def _gb(n: float | None) -> str:
    return "—" if n is None else f"{n / 1e9:,.2f} GB"


def plan_table(plan) -> str:
    """The plan for people: the layout, memory per stage by component, then the step's time by part."""
    config, layout, device = plan.config, plan.layout, plan.device
    lines = [f"layout: {layout.describe(config.data.seq_len)}",
             f"device: {device.name}, {_gb(device.memory_bytes)}, "
             + (f"{device.peak_flops / 1e12:,.3g} TFLOP/s peak" if device.peak_flops else "peak unknown"),
             "", f"{'memory per rank':<44}" + "".join(f"{'stage ' + str(i):>12}" for i in range(len(plan.stages)))]
    rows = [("parameters", "params"), ("gradients", "grads"), ("optimizer states (AdamW)", "optimizer"),
            ("DDP buckets", "buckets"), ("step: activations, gathered weights, temps", "step_peak"),
            ("  of which kept for the backward", "activations"), ("peak", "peak")]
    for label, key in rows:
        lines.append(f"  {label:<42}" + "".join(f"{_gb(getattr(s, key)):>12}" for s in plan.stages))
    headroom = plan.headroom_bytes
    if headroom is not None:
        lines.append(f"  {'headroom (10% of the device kept free)':<42}{_gb(headroom):>12}"
                     + ("" if plan.fits else "   DOES NOT FIT"))
    lines.append(f"  checkpoint: {_gb(plan.stages[0].checkpoint)} per rank, {_gb(plan.checkpoint_total_bytes)} in all")
    lines += ["", "step"]
    lines.append(f"  compute                  {plan.flops_per_rank / 1e12:,.1f} TFLOPs a rank, "
                 + (f"{plan.compute_s:.3f} s at {device.efficiency:.0%} of peak" if plan.compute_s is not None
                    else "time unknown (no peak FLOP/s)"))
    if plan.bubble:
        lines.append(f"  pipeline bubble          {plan.bubble:.0%} of the step")
    for dim, nbytes in plan.traffic.bytes.items():
        seconds = plan.comm_s[dim]
        where = "inside a node" if plan.traffic.inside_node[dim] else "across nodes"
        lines.append(f"  {dim:<24} {_gb(nbytes)} sent, " + (f"{seconds:.3f} s" if seconds is not None else "—")
                     + f" {where} ({plan.traffic.what[dim]})")
    if plan.step_s is not None:
        lines.append(f"  step time                {plan.step_s:.3f} s: {plan.tokens_per_s:,.0f} tokens/s, "
                     f"MFU {plan.mfu:.1%}")
    return "\n".join(lines)
