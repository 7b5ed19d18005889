"""What `clustertrain doctor` makes of every rank's record: one verdict, the same on every rank.

    result = diagnose(records, threshold=1.25)     # records: every rank's, in rank order (all_gather)
    result["ok"], result["failures"], result["bad_hosts"]
    print_report(result)                           # rank 0: the table, the failures, the verdict

A record is a dict: rank, host, facts (versions), findings (checks.Finding as dicts), free_memory (bytes on a GPU),
matmul_s, turn_s, links ({"a-b": round trip s}), dims (measure.measure_dims), noise_s (measure.noise_floor); rank
0's also planned_peak.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from clustertrain.doctor.checks import device_memory
from clustertrain.doctor.measure import slow_ranks

# The facts every rank must share with rank 0, in the order the table shows them.
VERSIONS = ("python", "torch", "gpu runtime", "nccl", "transformers", "clustertrain", "device", "backend")


def _where(records: list[dict], ranks: list[int]) -> str:
    """`rank 3 (nid01)` or `ranks 1, 5 (nid01, nid02)`."""
    hosts = list(dict.fromkeys(records[r]["host"] for r in ranks))
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown} ({', '.join(hosts[:8])}{', ...' if len(hosts) > 8 else ''})"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms"


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KiB"


def diagnose(records: list[dict], threshold: float) -> dict:
    """Every check's verdict over all ranks: rows for the table, one line per failure, the hosts at fault."""
    rows: list[tuple[str, bool, str]] = []
    failures: list[str] = []
    bad: list[int] = []  # ranks named at fault

    def fail(check: str, detail: str, ranks: list[int]) -> None:
        failures.append(f"{check}: {detail}")
        bad.extend(ranks)

    _versions(records, rows, fail)
    _findings(records, rows, fail)
    _matmul(records, threshold, rows, fail)
    _network(records, threshold, rows, fail)
    _dims(records, threshold, rows, fail)
    hosts = list(dict.fromkeys(r["host"] for r in records))
    bad_hosts = list(dict.fromkeys(records[r]["host"] for r in bad))
    return {"ok": not failures, "ranks": len(records), "hosts": hosts, "threshold": threshold,
            "rows": [{"check": c, "ok": ok, "detail": d} for c, ok, d in rows], "failures": failures,
            "bad_hosts": bad_hosts, "records": records}


def _versions(records: list[dict], rows: list, fail) -> None:
    first = records[0]["facts"]
    problems = 0
    for key in VERSIONS:
        other = defaultdict(list)
        for record in records[1:]:
            if record["facts"].get(key) != first.get(key):
                other[record["facts"].get(key)].append(record["rank"])
        for value, ranks in other.items():
            problems += 1
            fail("versions", f"{_where(records, ranks)} {'have' if len(ranks) > 1 else 'has'} {key} {value}, rank 0 "
                 f"has {first.get(key)}: run every rank from one environment (slurm.python, slurm.modules, "
                 "slurm.setup)", ranks)
    shown = ", ".join(f"{k} {first[k]}" for k in VERSIONS if first.get(k) is not None)
    rows.append(("versions", not problems, shown if not problems else f"{problems} differ from rank 0's (below)"))


def _findings(records: list[dict], rows: list, fail) -> None:
    by_check: dict[str, dict[tuple[bool, str], list[int]]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        for f in record["findings"]:
            by_check[f["check"]][f["ok"], f["detail"]].append(record["rank"])
    planned = records[0].get("planned_peak")
    if planned:
        for record in records:
            if record.get("free_memory") is not None:
                f = device_memory(f"{record['facts']['device']} of rank {record['rank']}", record["free_memory"],
                                  planned)
                by_check[f.check][f.ok, f.detail if not f.ok else f"plan peak fits on every rank ({f.detail})"
                                  ].append(record["rank"])
    for check, results in by_check.items():
        ran = {rank for ranks in results.values() for rank in ranks}
        failed = [(detail, ranks) for (ok, detail), ranks in results.items() if not ok]
        for detail, ranks in failed:
            # a problem every rank that checked has is the config's or the site's, not a host's
            everywhere = set(ranks) == ran
            fail(check, detail + ("" if everywhere else f" (on {_where(records, ranks)})"), [] if everywhere else ranks)
        passed = [detail for (ok, detail), _ in results.items() if ok]
        rows.append((check, not failed, f"{len(failed)} problem{'s' if len(failed) > 1 else ''} (below)" if failed
                     else passed[0] + (f" (and {len(passed) - 1} more)" if len(passed) > 1 else "")))


def _matmul(records: list[dict], threshold: float, rows: list, fail) -> None:
    seconds = [r["matmul_s"] for r in records]
    median = statistics.median(seconds)
    n, dtype = records[0]["matmul_size"]
    tflops = 2 * n**3 / median / 1e12
    slow = slow_ranks(seconds, threshold, records[0]["noise_s"])
    for r in slow:
        host = records[r]["host"]
        fail("matmul", f"{_where(records, [r])} took {_ms(seconds[r])} per {n}x{n} {dtype} matmul, "
             f"{seconds[r] / median:.1f}x the median {_ms(median)}: check its device (clocks, temperature, other "
             f"processes: nvidia-smi, rocm-smi), or leave the host out (sbatch --exclude={host})", [r])
    rows.append(("matmul", not slow, f"{n}x{n} {dtype}: median {_ms(median)} ({tflops:,.2f} TFLOP/s), slowest "
                 f"{_ms(max(seconds))} (rank {seconds.index(max(seconds))})"))


def _network(records: list[dict], threshold: float, rows: list, fail) -> None:
    if len(records) < 2:
        return
    nbytes = records[0]["link_bytes"]
    turns = [r["turn_s"] for r in records]
    median = statistics.median(turns)
    slow = slow_ranks(turns, threshold, records[0]["noise_s"])
    for r in slow:
        host = records[r]["host"]
        fail("network", f"{_where(records, [r])} took {_ms(turns[r])} to answer a {_size(nbytes)} ping-pong, "
             f"{turns[r] / median:.1f}x the median {_ms(median)}: check its network (NIC, ibstat, cxi_stat; "
             f"NCCL_SOCKET_IFNAME), or leave the host out (sbatch --exclude={host})", [r])
    links = {tuple(map(int, k.split("-"))): s for r in records for k, s in r["links"].items()}
    trips = list(links.values())
    slow_links = []
    if len(trips) >= 3:  # with one or two links there is no typical one to compare with
        median_trip = statistics.median(trips)
        for (a, b), s in links.items():
            if s > threshold * median_trip and s - median_trip > records[0]["noise_s"] and not {a, b} & set(slow):
                slow_links.append((a, b))
                fail("link", f"ranks {a} ({records[a]['host']}) and {b} ({records[b]['host']}): a {_size(nbytes)} "
                     f"round trip took {_ms(s)}, {s / median_trip:.1f}x the median {_ms(median_trip)}: check the "
                     "link between their hosts (cables, switch ports), or leave one host out", [a, b])
    rows.append(("network", not slow and not slow_links,
                 f"{_size(nbytes)} ping-pong with ring neighbours: median turn {_ms(median)}, "
                 f"{nbytes / median / 1e9:,.2f} GB/s; {len(links)} link{'s' if len(links) != 1 else ''}"))


def _dims(records: list[dict], threshold: float, rows: list, fail) -> None:
    """Bus bandwidth per mesh dimension; with several groups along a dimension, a group slower than the median
    group is named."""
    measured: dict[tuple, dict[tuple[int, ...], dict]] = defaultdict(dict)
    for record in records:
        for row in record["dims"]:
            measured[row["dim"], row["ranks"], row["kind"], row["bytes"]][tuple(row["group"])] = row
    by_dim: dict[tuple[str, int], list[str]] = defaultdict(list)
    for (dim, n, kind, nbytes), groups in measured.items():
        seconds = [g["seconds"] for g in groups.values()]
        worst = min(g["busbw"] for g in groups.values())
        by_dim[dim, n].append(f"{kind.replace('_', '-')} {_size(nbytes)} {worst / 1e9:,.2f} GB/s")
        if len(groups) > 2:
            for index in slow_ranks(seconds, threshold, records[0]["noise_s"]):
                ranks = list(list(groups)[index])
                fail("collective", f"{dim} group of {_where(records, ranks)}: {kind} of {_size(nbytes)} took "
                     f"{_ms(seconds[index])}, {seconds[index] / statistics.median(seconds):.1f}x the median group: "
                     "check these hosts' links", ranks)
    for (dim, n), parts in by_dim.items():
        groups = len(records) // n
        rows.append((f"{dim} busbw", True, f"{n} ranks x {groups} group{'s' if groups > 1 else ''}, slowest group: "
                     + "; ".join(parts)))


def print_report(result: dict) -> None:
    """The table, then one line per failure and the verdict (rank 0)."""
    import sys

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    # a job log is no terminal: rich would wrap it at 80 columns
    console = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 200)
    table = Table("check", "", "detail", box=None)
    for row in result["rows"]:
        table.add_row(Text(row["check"], style="bold"), Text("ok" if row["ok"] else "FAIL",
                      style="green" if row["ok"] else "red bold"), Text(row["detail"]))
    hosts = result["hosts"]
    console.print(f"doctor: {result['ranks']} rank{'s' if result['ranks'] > 1 else ''} on {len(hosts)} "
                  f"host{'s' if len(hosts) > 1 else ''}, slow = more than {result['threshold']:g}x the median")
    console.print(table)
    for line in result["failures"]:
        print(f"fail: {line}", flush=True)
    if result["bad_hosts"]:
        print(f"bad hosts: {','.join(result['bad_hosts'])}", flush=True)
    count = len(result["failures"])
    print("doctor: every check passed" if not count else f"doctor: {count} problem{'s' if count > 1 else ''}",
          flush=True)
