"""The monitor's cost: the main job with the monitor sampling every --every seconds against the
monitor off (metrics.every = 0), in the same run.

    .venv/bin/python scripts/bench_monitor.py [--steps 3000] [--pairs 3] [--ranks 4] [--every 1]
                                              [--out results/bench_monitor.json]

Runs the main job (examples/ctr.toml: 1 PS + 3 workers, sync) with the monitor on and off in
alternation, --pairs times each (the pair's order alternates too: this VM's speed drifts), and
reports each one's samples/s and the ratio of the medians (target: on >= 0.99x off). --every 1 is
ten times the default rate (metrics.every = 10). Each monitored run's records are counted: one per
host per sample. The time of one rank's sample (the /proc reads and statvfs, timed here in one
process, 2,000 times) over --every is the share of a CPU each rank gives the monitor, a figure that
does not drift with this VM's speed.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mpirun import run_mpi  # noqa: E402


def run(ranks: int, steps: int, every: float, config: str) -> tuple[float, int]:
    """samples/s of one run of the main job, and the monitor records it wrote."""
    with tempfile.TemporaryDirectory() as d:
        m = Path(d) / "m.jsonl"
        sets = [f"job.steps={steps}", "job.eval_every=0", "metrics.progress=false", f"metrics.every={every}",
                f"metrics.path={m}"]
        r = run_mpi(ranks, ["-m", "hpcps", "train", "--config", config, "--set", *sets], timeout=1800)
        records = sum('"monitor"' in line for line in m.read_text().splitlines())
    final = [json.loads(line) for line in r.stdout.splitlines() if line.startswith('{"final"')][-1]["final"]
    return float(final["samples_per_s"]), records


def sample_us(repeat: int = 2000) -> float:
    """Microseconds of one rank's sample of the system (hpcps.monitor.Monitor._common's reads)."""
    import time

    from hpcps.monitor import probe
    cpu = probe.CpuMeter()
    t0 = time.perf_counter()
    for _ in range(repeat):
        cpu.take()
        probe.memory_limit()
        probe.rss()
        probe.disk_free("/tmp")
    return 1e6 * (time.perf_counter() - t0) / repeat


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "examples" / "ctr.toml"))
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--every", type=float, default=1.0, help="seconds between the monitor's samples when on")
    ap.add_argument("--out", default="results/bench_monitor.json")
    a = ap.parse_args()
    got, records = {True: [], False: []}, []
    for i in range(a.pairs):
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            rate, n = run(a.ranks, a.steps, a.every if on else 0, a.config)
            got[on].append(rate)
            if on:
                records.append(n)
            print(f"pair {i}: monitor {'on' if on else 'off'}: {rate:,.0f} samples/s"
                  + (f", {n} host records" if on else ""), flush=True)
    med = {on: statistics.median(v) for on, v in got.items()}
    us = sample_us()
    report = {"steps": a.steps, "ranks": a.ranks, "pairs": a.pairs, "every_s": a.every,
              "on_samples_s": got[True], "off_samples_s": got[False], "host_records": records,
              "median_on": med[True], "median_off": med[False], "on_vs_off": med[True] / med[False],
              "sample_us": us, "sample_cpu_share": us * 1e-6 / a.every,
              "targets": {"on_vs_off": ">= 0.99"}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(f"median samples/s: monitor on (every {a.every:g} s) {med[True]:,.0f}, off {med[False]:,.0f}: "
          f"ratio {report['on_vs_off']:.3f} (target >= 0.99); one sample {us:.0f} us: "
          f"{100 * report['sample_cpu_share']:.4f}% of a CPU per rank at every {a.every:g} s")


if __name__ == "__main__":
    main()
