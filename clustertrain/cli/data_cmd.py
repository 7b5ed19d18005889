"""`clustertrain data audit RUN_DIR`: which samples a run (across its resumes) repeated or skipped."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("data", help="inspect a run's data")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    audit = actions.add_parser("audit", help="report repeated and skipped samples of a run with data.audit: true")
    audit.add_argument("run_dir", help="the run directory (holds samples.jsonl and config.yaml)")
    audit.add_argument("--no-replay", action="store_true", help="skip replaying the expected order from the config")
    audit.add_argument("--json", action="store_true", help="print the full report as JSON")
    audit.set_defaults(run=run_audit)


def run_audit(args: argparse.Namespace) -> int:
    from clustertrain.data.audit import audit_report, expected_samples, problem_lines, read_audit, read_starts
    from clustertrain.errors import UserError
    from clustertrain.resolve.load import load_checked_config
    from clustertrain.run_dir import RunDir

    run = RunDir(Path(args.run_dir))
    samples = run.samples
    if not samples.is_file():
        raise UserError(f"{samples} not found: train with data.audit: true to record samples")
    recorded = read_audit(samples)
    expected = None
    if not args.no_replay:
        config = load_checked_config(run.config)
        expected = expected_samples(config, max(recorded, default=0), read_starts(samples))
    report = audit_report(recorded, expected)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"steps {report['steps']}, samples {report['samples']}, missing steps {len(report['missing_steps'])}")
        print(f"repeated {len(report['repeated'])}"
              + (f", skipped {len(report['skipped'])}, unexpected {len(report['unexpected'])}" if expected else ""))
        print("proportions " + ", ".join(f"{k} {v:.3f}" for k, v in report["proportions"].items()))
        for line in problem_lines(report, recorded, expected):
            print(line)
    problems = report["repeated"] or report["missing_steps"] or report.get("skipped") or report.get("unexpected")
    return 1 if problems else 0
