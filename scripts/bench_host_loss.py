"""The large workload on pretend hosts: it trains with node-local, partner and filesystem
checkpoints, loses a host, restarts on the hosts left bit-equal to a straight run, then restarts
resharded from the filesystem level.

    .venv/bin/python scripts/bench_host_loss.py [--hosts 8] [--ranks 32] [--num-ps 8] [--reshard 6+18]
        [--scale 0.01] [--steps 40] [--out results/bench_host_loss.json]

Needs root: it makes pretend hosts h0..h(H-1) (scripts/cluster.sh, cluster "bl") and removes them
after. The job is examples/large.toml (MLPerf DLRM-DCNv2's 26 tables scaled by --scale, dim 128,
Adagrad, deterministic sync) with a smaller dense part (bottom 64, top 64-32, cross rank 32: the
reference's 16M dense parameters on every worker of 32 ranks do not fit this machine beside the
tables). Node-local checkpoints (in each host's /dev/shm, each PS's shard copied to a partner PS on
another host) every --local-every steps, filesystem ones every 2x that. The runs:
  straight   --ranks ranks on --hosts hosts, uninterrupted, exported
  lost       the same job again; once every host committed its part of a node-local checkpoint of
             a step >= 2x --local-every, every process of the last host is killed (-9) and its /dev/shm deleted
  restart    the same ranks on the hosts left: it must load the node-local level (the lost PS's
             shard from its partner copy) and end with the straight run's very bits
  reshard    --reshard P+W ranks on the hosts left, from the filesystem level of the finished
             restart (another PS count, so the node-local level does not apply); exported with no
             further step, it must equal the straight run's model bit for bit
Prints each run's seconds, and writes them, the checks and the ranks' peak RSS to --out. Exits 1
when a check fails.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hpcps.checkpoint import store

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from hostkit import assert_ended_unfinished, host_local_dir, kill_all, parts_of, pids_on  # noqa: E402
from mpirun import CLUSTER, launch_mpi, reap, run_mpi  # noqa: E402

SMALL_DENSE = ["model.bottom_mlp=[64]", "model.top_mlp=[64,32]", "model.cross_rank=32"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=8)
    p.add_argument("--ranks", type=int, default=32)
    p.add_argument("--num-ps", type=int, default=8)
    p.add_argument("--reshard", default="6+18", help="PS+workers of the resharded restart")
    p.add_argument("--scale", type=float, default=0.01, help="data.scale of examples/large.toml")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--local-every", type=int, default=5)
    p.add_argument("--timeout", type=float, default=1500, help="seconds a run may take")
    p.add_argument("--out", default="results/bench_host_loss.json")
    p.add_argument("--logs", default="", help="a folder for each run's stderr")
    a = p.parse_args(argv)
    a.reshard_ps, a.reshard_workers = (int(x) for x in a.reshard.split("+"))
    if a.hosts < 2 or a.num_ps < a.hosts or a.ranks <= a.num_ps:
        p.error("need 2 or more hosts, a PS on each (--num-ps >= --hosts) and workers besides")
    if a.steps < 3 * a.local_every:
        p.error("--steps must be at least 3x --local-every (the host is lost after the second)")
    return a


def spread(ranks: int, hosts: int) -> str:
    """``h0:n0,h1:n1,...``: ``ranks`` over ``hosts`` hosts, as even as it goes."""
    return ",".join(f"h{h}:{ranks // hosts + (h < ranks % hosts)}" for h in range(hosts))


def final_of(stdout: str) -> dict:
    lines = [json.loads(x)["final"] for x in stdout.splitlines() if x.startswith('{"final"')]
    if len(lines) != 1:
        raise AssertionError(f"no final summary:\n{stdout[-3000:]}")
    return lines[0]


def train(args, n, hosts, sets, timeout):
    t = time.perf_counter()
    r = run_mpi(n, ["-m", "hpcps", "train", "--config", ROOT / "examples" / "large.toml", "--set", *sets],
                timeout=timeout, hosts=hosts)
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
        (Path(args.logs) / f"{n}-{hosts}-{time.time():.0f}.log").write_text(r.stderr)
    return final_of(r.stdout), time.perf_counter() - t, r


def same_bits(a_path, b_path) -> bool:
    a, b = np.load(a_path), np.load(b_path)
    return set(a.files) == set(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)


def complete_step(args, ck, name):
    """A step from 2x ``--local-every`` on whose node-local parts on the hosts that stay (all but
    the last) hold every PS's shard (its own or a partner copy) and a dense part, or None."""
    shards, dense = {}, set()
    for h in range(args.hosts - 1):
        for part in parts_of(host_local_dir(f"h{h}", name, ck), ck, 2 * args.local_every):
            try:
                man = store.read_manifest(part)
            except (OSError, ValueError):
                continue                    # pruned meanwhile
            step = int(part.name[5:14])
            shards.setdefault(step, set()).update(man.get("shards", []))
            if man.get("dense"):
                dense.add(step)
    whole = [s for s, got in shards.items() if s in dense and got == set(range(args.num_ps))]
    return max(whole) if whole else None


def lose_a_host(args, hosts, sets, ck, out, name):
    """The run that loses host h(H-1) once h0 committed its second node-local checkpoint."""
    lost = f"h{args.hosts - 1}"
    t = time.perf_counter()
    proc = launch_mpi(args.ranks, ["-m", "hpcps", "train", "--config", ROOT / "examples" / "large.toml",
                                   "--set", *sets], env={"HPCPS_STEP_DELAY": "0.2"}, hosts=hosts)
    deadline = time.time() + args.timeout
    while time.time() < deadline and proc.poll() is None and complete_step(args, ck, name) is None:
        time.sleep(0.05)
    victims = pids_on(lost)
    kill_all(victims)
    code, so, se = reap(proc, timeout=300)
    assert_ended_unfinished(code, so + se, out)
    shutil.rmtree(host_local_dir(lost, name), ignore_errors=True)
    return {"host": lost, "processes_killed": len(victims), "seconds": time.perf_counter() - t}


def run_all(args, tmp: Path) -> dict:
    name = f"hpcps-bl-{os.getpid()}"
    base = [f"data.scale={args.scale}", f"job.num_ps={args.num_ps}", f"job.steps={args.steps}", *SMALL_DENSE,
            "metrics.progress=false", "data.eval_samples=5000", f"checkpoint.local_dir=/dev/shm/{name}",
            f"checkpoint.local_every={args.local_every}", "checkpoint.local_keep=1", f"checkpoint.every_steps={2 * args.local_every}"]
    hosts, fewer = spread(args.ranks, args.hosts), spread(args.ranks, args.hosts - 1)
    res = {"hosts": args.hosts, "ranks": args.ranks, "num_ps": args.num_ps, "scale": args.scale, "steps": args.steps}
    f, res["straight_s"], r = train(args, args.ranks, hosts, base + [f"checkpoint.dir={tmp / 'straight'}",
                                                                     f"job.export={tmp / 'straight.npz'}"], args.timeout)
    res["auc"] = f["auc"]
    res["peak_rss_mb"] = {"ps_max": max(f["memory"]["ps_peak_rss_mb"]), "worker_max": max(f["memory"]["worker_peak_rss_mb"])}
    for h in range(args.hosts):                 # its node-local parts are not needed: free the memory
        shutil.rmtree(host_local_dir(f"h{h}", name, tmp / "straight"), ignore_errors=True)
    print(f"straight: {args.ranks} ranks on {args.hosts} hosts, {res['straight_s']:.0f} s, AUC {f['auc']:.4f}", flush=True)
    ck, out = tmp / "ck", tmp / "w.npz"
    sets = base + [f"checkpoint.dir={ck}", f"job.export={out}"]
    res["lost"] = lose_a_host(args, hosts, sets, ck, out, name)
    print(f"lost: {res['lost']['host']}, {res['lost']['processes_killed']} processes killed", flush=True)
    f, res["restart_s"], r = train(args, args.ranks, fewer, sets, args.timeout)
    res["restart"] = {k: f[k] for k in ("restored_from", "start_step", "num_ps", "restore_s")}
    res["restart"]["rebuilt_from_partners"] = "copied from other hosts" in r.stderr
    res["restart"]["bit_equal"] = same_bits(out, tmp / "straight.npz")
    print(f"restart on {args.hosts - 1} hosts: {json.dumps(res['restart'])}", flush=True)
    n = args.reshard_ps + args.reshard_workers
    re_out = tmp / "reshard.npz"
    f, res["reshard_s"], r = train(args, n, spread(n, args.hosts - 1),
                                   base[:1] + [f"job.num_ps={args.reshard_ps}"] + base[2:]
                                   + [f"checkpoint.dir={ck}", f"job.export={re_out}"], args.timeout)
    res["reshard"] = {k: f[k] for k in ("restored_from", "start_step", "num_ps", "num_workers", "restore_s")}
    res["reshard"]["bit_equal"] = same_bits(re_out, tmp / "straight.npz")
    print(f"reshard to {args.reshard}: {json.dumps(res['reshard'])}", flush=True)
    return res


def checks(args, res) -> dict:
    rs, rh = res["restart"], res["reshard"]
    return {"restart_from_local": rs["restored_from"] == "local" and rs["start_step"] >= 2 * args.local_every,
            "restart_rebuilt_from_partners": rs["rebuilt_from_partners"],
            "restart_bit_equal": rs["bit_equal"],
            "reshard_from_filesystem": rh["restored_from"] == "pfs" and rh["start_step"] == args.steps
            and (rh["num_ps"], rh["num_workers"]) == (args.reshard_ps, args.reshard_workers),
            "reshard_bit_equal": rh["bit_equal"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["HPCPS_CLUSTER"] = os.environ.get("HPCPS_CLUSTER_BENCH", "bl")
    subprocess.run([str(CLUSTER), "up", str(args.hosts)], check=True, capture_output=True, text=True)
    try:
        with tempfile.TemporaryDirectory(prefix="hpcps-bl-") as tmp:
            res = run_all(args, Path(tmp))
    finally:
        subprocess.run([str(CLUSTER), "down", "--force"], capture_output=True, text=True)
    res["checks"] = checks(args, res)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    failed = [k for k, ok in res["checks"].items() if not ok]
    print(f"checks: {'all passed' if not failed else 'FAILED ' + ', '.join(failed)}; wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
