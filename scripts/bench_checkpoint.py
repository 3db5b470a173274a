"""Checkpoint benchmark with its baselines measured in the same run.

    .venv/bin/python scripts/bench_checkpoint.py [--dir /scratch/me/bench-ckpt] [--ranks 4]

Runs `hpcps train` on the synthetic DLRM job (1 PS + workers) with a large table and reports:
  write bandwidth   checkpoint bytes / (request -> commit: snapshot, HDF5, checksums and fsyncs),
                    median over the job's checkpoints (written back to back), against the median
                    of `dd ... conv=fsync` of the same number of bytes to the same directory, back
                    to back while the same job trains without checkpoints: the same CPU contention
                    (target >= 0.7x). The ratio against dd on the idle machine (before and after
                    the job) is printed too, and the writer alone (no training) in turns with dd
  training stall    the pause per checkpoint, as a share of a 60 s interval (target <= 2%)
  incremental size  a checkpoint holding only rows changed since the previous one, against the
                    full one, on the Zipf workload after a short interval (target >= 6x smaller)
  restart time      start of a resumed job to its first step, against the bytes it read
--part levels (also in --part all) compares the levels (README "Checkpoint levels") on the main
job (examples/ctr.toml as it is) and on a 1 GB table (8 x 1M rows of 16 floats, Adagrad: 512 MB
of rows and 512 MB of state), a checkpoint every 10 steps:
  stall             the workers' pause per checkpoint, summed over the run, as a share of its
                    training time (target for the node-local level <= 1%), and the throughput
                    against the same job without checkpoints, runs alternated (--rounds)
  write time        request -> commit of each level (node-local: full ones and deltas apart,
                    checkpoint.local_full_every as configured); node-local checkpoints taken
                    against those due (one due while the previous is written waits for it)
  restore time      a restart's restore_s from the node-local level (/dev/shm) and from the
                    filesystem (--dir; page cache dropped first when run as root, as a parallel
                    filesystem's client would read it cold; warm otherwise), --restores of each,
                    the local ones first, medians (target: local >= 5x faster)
Writes JSON (--out) and prints the ratios.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mpirun import launch_mpi, reap, run_mpi  # noqa: E402



def final(stdout):
    return [json.loads(line) for line in stdout.splitlines() if line.startswith('{"final"')][-1]["final"]


def dd(path: Path, nbytes: int) -> float:
    count = max(1, nbytes // (4 << 20))
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={count}", "conv=fsync"],
                   check=True, capture_output=True)
    dt = time.perf_counter() - t0
    path.unlink()
    return count * (4 << 20) / dt


def dd_series(path: Path, nbytes: int, n: int) -> list[float]:
    """``n`` dd writes back to back, like the checkpoints of a job (a short pause between)."""
    out = []
    for _ in range(n):
        out.append(dd(path, nbytes))
        time.sleep(0.3)
    return out


def dd_under_load(ranks: int, base: list, root: Path, nbytes: int, n: int) -> tuple[list[float], bool]:
    """The dd series while the same job trains without checkpoints: the CPU contention a
    checkpoint writer meets on an oversubscribed node. Returns (MB/s each, job still training)."""
    metrics = root / "load.jsonl"
    proc = launch_mpi(ranks, base + ["job.steps=1000000", f"metrics.path={metrics}", "job.log_every=10"])
    try:
        deadline = time.time() + 300
        while not (metrics.exists() and metrics.stat().st_size > 0):
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the load job did not start training: {reap(proc, 5)[2][-2000:]}")
            time.sleep(0.2)
        out = dd_series(root / "dd.bin", nbytes, n)
        return out, proc.poll() is None
    finally:
        reap(proc, timeout=0.1)


def writer_alone(root: Path, nbytes: int, pairs: int) -> tuple[list[float], list[float]]:
    """The PS writer path alone (HDF5 layout, bulk write, SHA-256, fsync) on a snapshot of
    ``nbytes``, in turns with dd of the same size: (writer MB/s each, dd MB/s each)."""
    import numpy as np

    from hpcps.checkpoint.shards import write_shard
    rows = nbytes // (8 * (8 + 2 * 16 * 4))
    rng = np.random.default_rng(0)
    tables = {f"t{i}": {"ids": np.arange(rows, dtype=np.int64), "applies": 1, "num_rows": rows, "dim": 16,
                        "weights": rng.random((rows, 16), np.float32), "optimizer": "Adagrad",
                        "state": {"sum": rng.random((rows, 16), np.float32)}} for i in range(8)}
    size = sum(a.nbytes for t in tables.values() for a in (t["ids"], t["weights"], t["state"]["sum"]))
    mine, theirs = [], []
    for _ in range(pairs):
        t0 = time.perf_counter()
        write_shard(root / "alone.h5", 1, 0, 1, tables)
        mine.append(size / (time.perf_counter() - t0))
        (root / "alone.h5").unlink()
        (root / "alone.h5.sha256").unlink()
        time.sleep(0.3)
        theirs.append(dd(root / "dd.bin", size))
        time.sleep(0.3)
    return mine, theirs


def _run(ranks, base, sets, timeout=3600):
    r = run_mpi(ranks, base + sets, timeout=timeout)
    return final(r.stdout)


def drop_caches() -> bool:
    """Empty the page cache (root only): the next read of the filesystem level is cold."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def restores(ranks: int, base: list, root: Path, shm: Path, steps: int, last: int, repeats: int) -> dict:
    """Restarts of round ``last``'s runs, ``repeats`` of each (each restart's own final checkpoint
    removed after it): the local run's with its filesystem checkpoints removed (it loads its newest
    node-local step), then the filesystem run's, each read cold. The local ones go first: on this
    VM a page-cache drop slowed the restarts after it (1 GB local restores 0.86-0.97 s
    after one, 0.55-0.62 s before). ``{level: [restore_s]}``."""
    out = {"local": [], "pfs_cold": [], "pfs_warm": []}
    ck = root / f"local-{last}"
    for p in store_list(ck):
        shutil.rmtree(p)
    for _ in range(repeats):
        subprocess.run(["sync"], check=True)        # the last restart's writes flushed: not in this one's way
        f = _run(ranks, base, [f"job.steps={steps + 1}", f"checkpoint.dir={ck}", f"checkpoint.local_dir={shm / str(last)}"])
        assert f["restored_from"] == "local", f["restored_from"]
        out["local"].append(f["restore_s"])
        for p in store_list(ck):
            shutil.rmtree(p)
    ck = root / f"pfs-{last}"
    for _ in range(repeats):
        cold = drop_caches()
        f = _run(ranks, base, [f"job.steps={steps + 1}", f"checkpoint.dir={ck}"])
        assert f["restored_from"] == "pfs", f["restored_from"]
        out["pfs_cold" if cold else "pfs_warm"].append(f["restore_s"])
        for p in store_list(ck):
            if int(p.name.split("-")[1]) > steps:
                shutil.rmtree(p)
    return {k: v for k, v in out.items() if v}


def level_runs(ranks: int, base: list, root: Path, steps: int, rounds: int, repeats: int = 3) -> dict:
    """Runs without checkpoints, with node-local ones and with filesystem ones every 10 steps, in
    turns; each level's stall share, write time, throughput against none, then restore times."""
    shm = Path(f"/dev/shm/hpcps-bench-{os.getpid()}")
    out = {"none": [], "local": [], "pfs": []}
    try:
        for i in range(rounds):
            order = ["none", "local", "pfs"][i % 3:] + ["none", "local", "pfs"][:i % 3]
            for level in order:
                ck = root / f"{level}-{i}"
                sets = [f"job.steps={steps}"]
                if level == "local":
                    sets += [f"checkpoint.dir={ck}", f"checkpoint.local_dir={shm / str(i)}", "checkpoint.local_every=10"]
                elif level == "pfs":
                    sets += [f"checkpoint.dir={ck}", "checkpoint.every_steps=10", "checkpoint.keep=2"]
                f = _run(ranks, base, sets)
                mine = [t for t in f["checkpoint_timings"] if t["step"] < steps and
                        (t["kind"].startswith("local") if level == "local" else t["kind"] == "full")]
                out[level].append({"samples_s": f["samples_per_s"], "elapsed_s": f["elapsed_s"],
                                   "stall_s": sum(t["stall_s"] for t in mine), "checkpoints": len(mine),
                                   "write_s": [t["write_s"] for t in mine],
                                   "write_full_s": [t["write_s"] for t in mine if t["kind"] in ("local", "full")],
                                   "write_delta_s": [t["write_s"] for t in mine if t["kind"] == "local-delta"],
                                   "deferred_steps": f.get("local_deferred_steps", 0)})
        restore = restores(ranks, base, root, shm, steps, rounds - 1, repeats)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    med = {k: statistics.median(x["samples_s"] for x in v) for k, v in out.items()}
    summary = {level: {"stall_share": statistics.median(x["stall_s"] / x["elapsed_s"] for x in out[level]),
                       "stall_per_checkpoint_s": statistics.median(x["stall_s"] / max(x["checkpoints"], 1)
                                                                   for x in out[level]),
                       "write_s": statistics.median(w for x in out[level] for w in x["write_s"]),
                       "write_full_s": _median([w for x in out[level] for w in x["write_full_s"]]),
                       "write_delta_s": _median([w for x in out[level] for w in x["write_delta_s"]]),
                       "checkpoints": statistics.median(x["checkpoints"] for x in out[level]),
                       "due": len(range(10, steps, 10)),
                       "deferred_steps": statistics.median(x["deferred_steps"] for x in out[level]),
                       "throughput_vs_none": med[level] / med["none"]} for level in ("local", "pfs")}
    med_restore = {k: statistics.median(v) for k, v in restore.items()}
    return {"runs": out, "levels": summary, "restore_runs_s": restore, "restore_s": med_restore,
            "restore_pfs_vs_local": {k: v / max(med_restore["local"], 1e-9) for k, v in med_restore.items()
                                     if k != "local"}}


def _median(xs: list):
    return statistics.median(xs) if xs else None


def store_list(ck: Path) -> list:
    from hpcps.checkpoint import store
    return store.list_checkpoints(ck)


def print_levels(name: str, r: dict) -> None:
    for level, x in r["levels"].items():
        writes = f"write {x['write_s']:.2f} s"
        if x["write_delta_s"] is not None:
            writes = f"write full {x['write_full_s']:.2f} s / delta {x['write_delta_s']:.2f} s"
        print(f"  {name} {level:5}: stall {100 * x['stall_share']:.2f}% of training "
              f"({1e3 * x['stall_per_checkpoint_s']:.1f} ms a checkpoint; target for local <= 1%), {writes}, "
              f"{x['checkpoints']:g} taken of {x['due']} due ({x['deferred_steps']:g} steps deferred), "
              f"throughput {x['throughput_vs_none']:.3f}x no checkpoints")
    rs = r["restore_s"]
    print(f"  {name} restore (median of {len(r['restore_runs_s']['local'])}): local {rs['local']:.3f} s; " + ", ".join(
        f"{k} {rs[k]:.3f} s ({r['restore_pfs_vs_local'][k]:.1f}x local)" for k in rs if k != "local")
        + " (target >= 5x)")


def main_levels(a, root: Path) -> dict:
    cfg = ["-m", "hpcps", "train", "--config", ROOT / "examples" / "ctr.toml", "--set", "metrics.progress=false",
           "job.eval_every=0", "data.eval_samples=2000"]
    report = {}
    for name, rows, steps in (("main", None, a.level_steps), ("table_1gb", a.level_big_rows, a.level_steps_big)):
        if name not in a.workloads.split(","):
            continue
        base = cfg + ([f"data.rows_per_table={rows}"] if rows else [])
        report[name] = level_runs(a.ranks, base, root / name, steps, a.rounds, a.restores)
        print_levels(name, report[name])
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="results/bench-ckpt")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rows", type=int, default=400_000, help="rows per table (8 tables, dim 16)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="results/bench_checkpoint.json")
    ap.add_argument("--part", choices=("all", "pfs", "levels"), default="all",
                    help="pfs: the filesystem level's figures; levels: the levels compared; all: both")
    ap.add_argument("--rounds", type=int, default=3, help="levels: alternated rounds")
    ap.add_argument("--level-steps", type=int, default=300, help="levels: steps of the main job's runs")
    ap.add_argument("--level-steps-big", type=int, default=100, help="levels: steps of the 1 GB table's runs")
    ap.add_argument("--level-big-rows", type=int, default=1 << 20,
                    help="levels: rows per table of the large workload (8 tables; 1M: 1 GB with Adagrad's state)")
    ap.add_argument("--restores", type=int, default=3, help="levels: restarts from each level (medians)")
    ap.add_argument("--workloads", default="main,table_1gb", help="levels: which workloads (comma-separated)")
    a = ap.parse_args()
    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    if a.part == "levels":
        report = {"levels": main_levels(a, root / "levels")}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=1))
        print(f"  wrote {a.out}")
        return 0
    base = ["-m", "hpcps", "train", "--config", ROOT / "examples" / "ctr.toml", "--set",
            f"data.rows_per_table={a.rows}", "data.eval_samples=2000", "metrics.progress=false", "metrics.path=",
            "job.eval_every=0"]
    # 1. full checkpoints every 10 steps: bandwidth and stall, with dd series before and after
    nominal = a.rows * 8 * 16 * 4 * 2
    dd_before = dd_series(root / "dd.bin", nominal, 4)
    full_dir = root / "full"
    r = run_mpi(a.ranks, base + [f"checkpoint.dir={full_dir}", "checkpoint.every_steps=10", "checkpoint.keep=1",
                                 f"job.steps={a.steps}"], timeout=1200)
    f = final(r.stdout)
    timings = f["checkpoint_timings"]
    nbytes = max(t["bytes"] for t in timings)
    bw = sorted(t["bytes"] / t["write_s"] for t in timings)
    dd_after = dd_series(root / "dd.bin", nbytes, 4)
    dd_all = sorted(dd_before + dd_after)
    dd_idle = statistics.median(dd_all)
    dd_load, loaded = dd_under_load(a.ranks, base, root, nbytes, 4)
    dd_bw = statistics.median(dd_load)
    alone, alone_dd = writer_alone(root, nbytes, 4)
    stall = max(t["stall_s"] for t in timings)
    # 2. incremental: a full one, then one holding the rows of the next 10 steps only
    inc_dir = root / "inc"
    r = run_mpi(a.ranks, base + [f"checkpoint.dir={inc_dir}", "checkpoint.every_steps=10", "checkpoint.full_every=100",
                                 "checkpoint.keep=0", "job.steps=20"], timeout=1200)
    inc = {t["kind"]: t["bytes"] for t in final(r.stdout)["checkpoint_timings"]}
    # 3. restart: resume the full run and time start -> first step
    t0 = time.perf_counter()
    r = run_mpi(a.ranks, base + [f"checkpoint.dir={full_dir}", f"job.steps={a.steps + 1}"], timeout=1200)
    wall = time.perf_counter() - t0
    rf = final(r.stdout)
    report = {
        "config": {"ranks": a.ranks, "rows_per_table": a.rows, "tables": 8, "dim": 16, "dir": str(root)},
        "checkpoint_bytes": nbytes,
        "write_bandwidth_mb_s": statistics.median(bw) / 1e6,
        "dd_bandwidth_mb_s": dd_bw / 1e6, "dd_under_training_load": loaded,
        "write_vs_dd": statistics.median(bw) / dd_bw,
        "dd_idle_mb_s": dd_idle / 1e6, "write_vs_idle_dd": statistics.median(bw) / dd_idle,
        "writer_alone_mb_s": [x / 1e6 for x in alone], "writer_alone_dd_mb_s": [x / 1e6 for x in alone_dd],
        "writer_alone_vs_dd": statistics.median(alone) / statistics.median(alone_dd),
        "write_bandwidth_each_mb_s": [b / 1e6 for b in bw],
        "dd_each_mb_s": {"idle_before": [b / 1e6 for b in dd_before], "idle_after": [b / 1e6 for b in dd_after],
                         "under_load": [b / 1e6 for b in dd_load]},
        "stall_s": stall, "stall_share_of_60s": stall / 60,
        "incremental_bytes": inc.get("delta"), "full_bytes": inc.get("full"),
        "incremental_ratio": inc["full"] / inc["delta"] if inc.get("delta") else None,
        "restore_s": rf["restore_s"], "restore_mb_s": nbytes / max(rf["restore_s"], 1e-9) / 1e6,
        "resumed_job_wall_s": wall,
        "targets": {"write_vs_dd": 0.7, "stall_share_of_60s": 0.02, "incremental_ratio": 6.0},
    }
    print(f"checkpoint bench: {nbytes / 1e6:.1f} MB per full checkpoint, {a.ranks} ranks")
    def each(xs):
        return " ".join(f"{x / 1e6:.0f}" for x in xs)
    print(f"  write {report['write_bandwidth_mb_s']:.0f} MB/s (median of checkpoints {each(bw)}) vs dd while the "
          f"same job trains {report['dd_bandwidth_mb_s']:.0f} MB/s ({each(sorted(dd_load))}"
          f"{'' if loaded else '; THE JOB ENDED DURING THE SERIES'}): {report['write_vs_dd']:.2f}x (target >= 0.7)")
    print(f"    vs dd on the idle machine {dd_idle / 1e6:.0f} MB/s ({each(dd_all)}): {report['write_vs_idle_dd']:.2f}x")
    print(f"  writer alone (no training) {statistics.median(alone) / 1e6:.0f} MB/s ({each(alone)}) vs dd in turns "
          f"{statistics.median(alone_dd) / 1e6:.0f} MB/s ({each(alone_dd)}): {report['writer_alone_vs_dd']:.2f}x")
    print(f"  stall {stall * 1e3:.0f} ms per checkpoint = {100 * stall / 60:.2f}% of a 60 s interval (target <= 2%)")
    if report["incremental_ratio"]:
        print(f"  incremental {inc['delta'] / 1e6:.2f} MB vs full {inc['full'] / 1e6:.2f} MB: "
              f"{report['incremental_ratio']:.1f}x smaller (target >= 6)")
    print(f"  restore {rf['restore_s']:.2f} s for {nbytes / 1e6:.1f} MB ({report['restore_mb_s']:.0f} MB/s)")
    if a.part == "all":
        report["levels"] = main_levels(a, root / "levels")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(f"  wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
