"""Live failover against the restart path: seconds from a rank's SIGKILL to the job's next completed
step, and what standing by costs a job that loses nothing (one host; Open MPI with ULFM); and a live
rebalance onto a standby, samples/s after against before (any MPI).

    HPCPS_MPI=openmpi .venv/bin/python scripts/bench_failover.py [--parts failover,rebalance]
        [--config examples/ctr.toml] [--ranks 4] [--num-ps 1] [--standby 1] [--steps 150] [--rounds 3]
        [--victim 1] [--row-delay 2e-4] [--set KEY=VALUE ...] [--out results/bench_failover.json]

Each round runs, in turn:
  live      --ranks + --standby ranks, ``mpiexec --with-ft ulfm``, job.standby = --standby; once the
            first checkpoint exists (every 10 steps), launch rank --victim is killed -9; the job goes on
            (a standby takes the rank's place, every rank resumes from the last checkpoint)
  restart   --ranks ranks, plain ``mpiexec``, the same kill: the launch ends, and the same command is
            started again (resume = auto: it loads the last checkpoint), as a requeued batch job would
            once the queue gives it nodes (the queue wait is not counted)
  steady    the job with and without --standby standbys under ULFM, nothing killed, 4x --steps
            (which goes first alternates by round): samples/s
  rebalance tests/configs/tiny_ctr.toml on --ranks ranks (1 PS) + 1 standby, sync, 400 steps, its PS
            made short of CPU: every apply takes --row-delay s more per row it updates
            (tests/programs/monitor_cases.py slow_rows; a second PS halves that work, as one on a free
            CPU would); monitor.on_alert = rebalance: the PS overloaded alert makes the standby a
            second PS while the job runs. samples/s of the metrics records after the rebalance against
            before (medians, the first record of each leg left out)
Every rank starts as a fresh interpreter (the benchmark starts no test fork server), as users launch
them. The recovery time is the time from the kill to the first step the job completes afterwards (the
metrics records, one per step). Prints the medians and their ratio (restart / live), and writes every
figure to --out.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mpirun import launch_mpi, rank_pid, reap, run_mpi  # noqa: E402

from hpcps.checkpoint import store  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "examples" / "ctr.toml"))
    p.add_argument("--ranks", type=int, default=4, help="ranks that train (PS and workers)")
    p.add_argument("--num-ps", type=int, default=1)
    p.add_argument("--standby", type=int, default=1)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--victim", type=int, default=1, help="the launch rank killed")
    p.add_argument("--set", nargs="*", default=[], help="more config settings for every run")
    p.add_argument("--parts", default="failover,rebalance", help="failover (needs Open MPI), rebalance")
    p.add_argument("--row-delay", type=float, default=2e-4, help="rebalance: the starved PS's seconds more a row")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default="results/bench_failover.json")
    a = p.parse_args(argv)
    a.parts = set(a.parts.split(","))
    if a.parts - {"failover", "rebalance"}:
        p.error("--parts: failover, rebalance")
    if "failover" in a.parts and os.environ.get("HPCPS_MPI") != "openmpi":
        p.error("live failover needs ULFM: run with HPCPS_MPI=openmpi (or --parts rebalance)")
    if not 0 <= a.victim < a.ranks:
        p.error("--victim must be a launch rank that trains (0 .. --ranks - 1)")
    return a


def settings(args, d: Path, extra=()) -> list:
    return [f"job.steps={args.steps}", f"job.num_ps={args.num_ps}", "job.eval_every=0", "checkpoint.every_steps=10",
            f"checkpoint.dir={d / 'ck'}", f"metrics.path={d / 'm.jsonl'}", "job.log_every=1", "metrics.progress=false",
            "data.eval_samples=5000", *args.set, *extra]


def argv_of(args, sets) -> list:
    return ["-m", "hpcps", "train", "--config", args.config, "--set", *sets]


def first_step_after(metrics: Path, t: float) -> float:
    """Seconds from ``t`` to the first step record of a run started after ``t`` (its own clock)."""
    start = None
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        if "start" in rec:
            start = rec["start"]["unix"] if rec["start"]["unix"] > t else None
        elif start is not None and "step" in rec:
            return start + rec["time"] - t
    raise AssertionError(f"no step after the kill in {metrics}")


def kill_after_first_checkpoint(proc, d: Path, victim: int) -> float:
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not store.list_checkpoints(d / "ck"):
        time.sleep(0.02)
    time.sleep(0.5)
    pid = rank_pid(proc.tag, victim)
    if not pid:
        raise AssertionError(f"launch rank {victim} not found")
    t = time.time()
    os.kill(pid, 9)
    return t


def final_of(stdout: str) -> dict:
    lines = [json.loads(x)["final"] for x in stdout.splitlines() if x.startswith('{"final"')]
    if not lines:
        raise AssertionError(f"no final summary:\n{stdout[-3000:]}")
    return lines[-1]


def live(args, d: Path) -> dict:
    n = args.ranks + args.standby
    proc = launch_mpi(n, argv_of(args, settings(args, d, [f"job.standby={args.standby}"])),
                      env={"HPCPS_STEP_DELAY": "0.02"}, ft=True)
    t_kill = kill_after_first_checkpoint(proc, d, args.victim)
    code, out, err = reap(proc, timeout=args.timeout)
    if code != 0:
        raise AssertionError(f"the live run ended {code}:\n{err[-3000:]}")
    rec = final_of(out)["recoveries"][0]
    return {"seconds": first_step_after(d / "m.jsonl", t_kill), "record": rec}


def restart(args, d: Path) -> dict:
    sets = settings(args, d)
    proc = launch_mpi(args.ranks, argv_of(args, sets), env={"HPCPS_STEP_DELAY": "0.02"})
    t_kill = kill_after_first_checkpoint(proc, d, args.victim)
    code, _, _ = reap(proc, timeout=args.timeout)
    ended = time.time() - t_kill
    r = run_mpi(args.ranks, argv_of(args, sets), timeout=args.timeout)
    f = final_of(r.stdout)
    return {"seconds": first_step_after(d / "m.jsonl", t_kill), "launch_ended_s": round(ended, 3),
            "launch_exit": code, "restore_s": f["restore_s"], "start_step": f["start_step"]}


def steady(args, d: Path, standby: int) -> float:
    sets = settings(args, d, [f"job.standby={standby}", f"job.steps={4 * args.steps}"])
    r = run_mpi(args.ranks + standby, argv_of(args, sets), timeout=args.timeout, ft=True)
    return final_of(r.stdout)["samples_per_s"]


def rebalance(args, d: Path) -> dict:
    sets = ["job.steps=400", "metrics.every=0.3", f"checkpoint.dir={d / 'ck'}", f"metrics.path={d / 'm.jsonl'}",
            "monitor.on_alert=rebalance", "job.standby=1", "job.log_every=10", "metrics.progress=false"]
    r = run_mpi(args.ranks + 1, ["monitor_cases.py", "slow_rows", "--config", ROOT / "tests" / "configs" / "tiny_ctr.toml",
                                 "--set", *sets], env={"HPCPS_TEST_ROW_DELAY": str(args.row_delay)},
                timeout=args.timeout, check=False)
    legs: dict = {}
    for line in (d / "m.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "samples_per_s" in rec:
            legs.setdefault(rec["run"], []).append(rec["samples_per_s"])
    if r.returncode not in (0, 85) or len(legs) < 2:
        raise AssertionError(f"no rebalance (exit {r.returncode}):\n{r.stderr[-3000:]}")
    before, after = (statistics.median(v[1:] or v) for v in list(legs.values())[:2])
    rec = final_of(r.stdout)["recoveries"][0]
    return {"before": before, "after": after, "ratio": after / before, "record": rec}


def main(argv=None) -> int:
    args = parse_args(argv)
    res = {"config": args.config, "ranks": args.ranks, "standby": args.standby, "steps": args.steps, "rounds": []}
    if "rebalance" in args.parts:
        res["rebalance"] = []
        for i in range(args.rounds):
            with tempfile.TemporaryDirectory(prefix="hpcps-rb-") as tmp:
                res["rebalance"].append(rebalance(args, Path(tmp)))
            r = res["rebalance"][-1]
            print(f"rebalance {i + 1}: {r['before']:,.0f} -> {r['after']:,.0f} samples/s ({r['ratio']:.2f}x), "
                  f"{r['record'].get('seconds_to_next_step', 0):.2f} s to the next step", flush=True)
        res["rebalance_ratio"] = statistics.median(r["ratio"] for r in res["rebalance"])
        print(f"rebalance: samples/s after / before (median of {args.rounds}): {res['rebalance_ratio']:.2f}x")
    for i in range(args.rounds if "failover" in args.parts else 0):
        with tempfile.TemporaryDirectory(prefix="hpcps-fo-") as tmp:
            tmp = Path(tmp)
            row = {}
            for name, fn in (("live", live), ("restart", restart)):
                (tmp / name).mkdir()
                row[name] = fn(args, tmp / name)
            for k in (0, args.standby)[::1 if i % 2 == 0 else -1]:       # alternating which goes first
                (tmp / f"s{k}").mkdir()
                row[f"samples_per_s_standby_{k}"] = steady(args, tmp / f"s{k}", k)
        res["rounds"].append(row)
        print(f"round {i + 1}: live {row['live']['seconds']:.2f} s, restart {row['restart']['seconds']:.2f} s; "
              f"samples/s {row['samples_per_s_standby_0']:,.0f} without standbys, "
              f"{row[f'samples_per_s_standby_{args.standby}']:,.0f} with {args.standby}", flush=True)
    if "failover" in args.parts:
        summarize(args, res)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


def summarize(args, res) -> None:
    """The failover part's medians and ratios, printed and put in ``res``."""
    med = {k: statistics.median(r[k]["seconds"] for r in res["rounds"]) for k in ("live", "restart")}
    cost = [r[f"samples_per_s_standby_{args.standby}"] / r["samples_per_s_standby_0"] for r in res["rounds"]]
    res["median_s"] = med
    res["restart_over_live"] = med["restart"] / med["live"]
    res["standby_speed_ratio"] = statistics.median(cost)
    print(f"recovery, kill to next completed step (median of {args.rounds}): live {med['live']:.2f} s, restart "
          f"{med['restart']:.2f} s: {res['restart_over_live']:.1f}x faster live; with {args.standby} standby "
          f"{res['standby_speed_ratio']:.3f}x the samples/s")


if __name__ == "__main__":
    sys.exit(main())
