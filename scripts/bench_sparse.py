"""Sparse pull/push microbenchmark with its baselines measured in the same run.

    scripts/run mpiexec -n 2 .venv/bin/python -m mpi4py scripts/bench_sparse.py
    (1 PS + 1 worker; more ranks add workers, --num-ps adds PS ranks)

Per worker it times, on the same pre-drawn batches of random ids:
  local_gather    np.take from a private array of the same size, a new array per batch as a
                  pull returns (the limit for pull); timed in turns with the pulls below
  local_index_add torch.index_add_ into a private tensor             (the reference for push)
  two_sided       send ids to the PS, the PS gathers and sends rows back
  hpcps_auto      hpcps pull/push, same-node shards through shared memory, after one pass over
                  every page of the table (warm)
  hpcps_cold      hpcps pull of a table made just before, nothing of it read first (cold): the
                  first timed batch is the program's first pull of it
  hpcps_rma       hpcps pull/push forced onto RMA (the cross-node path),
                  reads by MPI_Get_accumulate(NO_OP) (the default) and by MPI_Get
  hpcps_dynamic   a DynamicEmbeddingTable of the same ids (all stored): pulls, and sync steps
                  (pull, push, apply), in 5 turns with the fixed table's (hpcps_fixed_*) on
                  the same batches; each ratio is the median of the turns' ratios, the push's
                  the ratio of a step's time less its pull's
and on the PS the resident memory a table adds against its bytes. Prints M rows/s,
GB/s and the ratios against the targets; writes JSON (--out).
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

import hpcps
from hpcps.core.ids import splitmix64

hpcps.prepare_process()       # before MPI starts (README, "Python API")
from mpi4py import MPI  # noqa: E402

TAG_IDS, TAG_ROWS = 11, 12


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def timed(fn, batches, reps=1, label="", warm=True):
    if warm:
        fn(batches[0])                                         # warm
    t0 = time.perf_counter()
    for _ in range(reps):
        for ids in batches:
            fn(ids)
    rate = len(batches) * reps * batches[0].size / (time.perf_counter() - t0)
    if os.environ.get("BENCH_VERBOSE"):
        print(f"[rank {MPI.COMM_WORLD.Get_rank()}] {fn}: {rate / 1e6:.2f} M rows/s", file=sys.stderr, flush=True)
    return rate


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=200, help="batches per measurement")
    ap.add_argument("--num-ps", type=int, default=1)
    ap.add_argument("--out", default="results/bench_sparse.json")
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    N, D, B = args.rows, args.dim, args.batch
    ctx = hpcps.init(num_ps=args.num_ps)
    rng = np.random.default_rng(1234 + world.Get_rank())
    batches = [rng.integers(0, N, B) for _ in range(args.iters)]
    grads = np.full((B, D), 1e-3, np.float32)
    res = {}

    # --- local baselines (worker's private copy) --------------------------
    if ctx.is_worker:
        import torch
        local = hpcps.initial_rows(0, "local", np.arange(N), D)

        def gather(ids):
            return np.take(local, ids, axis=0)
        res["local_gather"] = timed(gather, batches)
        lt, gt = torch.from_numpy(local), torch.from_numpy(grads)
        res["local_index_add"] = timed(lambda ids: lt.index_add_(0, torch.from_numpy(ids), gt, alpha=-0.1), batches)
        del lt

    # --- two-sided baseline: ids out, rows back ----------------------------
    ps0 = ctx.ps_world_ranks[0]
    if ctx.is_ps and ctx.ps_rank == 0:
        shard = hpcps.initial_rows(0, "two-sided", np.arange(N), D)
        status, open_workers = MPI.Status(), ctx.num_workers
        idbuf = np.empty(B, np.int64)
        rows = np.empty((B, D), np.float32)
        while open_workers:
            world.Recv([idbuf, MPI.INT64_T], source=MPI.ANY_SOURCE, tag=TAG_IDS, status=status)
            n = status.Get_count(MPI.INT64_T)
            if n == 0:
                open_workers -= 1
                continue
            np.take(shard, idbuf[:n], axis=0, out=rows[:n])
            world.Send([rows[:n], MPI.FLOAT], dest=status.Get_source(), tag=TAG_ROWS)
        del shard
    elif ctx.is_worker:
        rows = np.empty((B, D), np.float32)

        def two_sided(ids):
            world.Send([ids, MPI.INT64_T], dest=ps0, tag=TAG_IDS)
            world.Recv([rows, MPI.FLOAT], source=ps0, tag=TAG_ROWS)
        ctx.worker_comm.Barrier()
        res["two_sided_pull"] = timed(two_sided, batches)
        world.Send([np.empty(0, np.int64), MPI.INT64_T], dest=ps0, tag=TAG_IDS)

    # --- hpcps --------------------------------------------------------------
    rss0 = rss_bytes()
    auto = hpcps.EmbeddingTable(ctx, "bench", N, D, optimizer=hpcps.optim.SGD(lr=0.1), transport="auto")
    rss1 = rss_bytes()
    rma = hpcps.EmbeddingTable(ctx, "bench-rma", N, D, optimizer=hpcps.optim.SGD(lr=0.1), transport="rma")
    rma_get = hpcps.EmbeddingTable(ctx, "bench-rma-get", N, D, transport="rma", rma_read="get")
    # cold: nothing of it read before its timed pulls (no pass over its pages, no untimed first batch)
    cold = hpcps.EmbeddingTable(ctx, "bench-cold", N, D, optimizer=hpcps.optim.SGD(lr=0.1), transport="auto")
    # capacity with headroom: ids spread over the PS ranks by a hash, not evenly
    dyn = hpcps.DynamicEmbeddingTable(ctx, "bench-dyn", D, N + N // 4, optimizer=hpcps.optim.SGD(lr=0.1))
    if ctx.is_ps:
        res["ps_table_bytes"] = auto.rows.nbytes + 8
        res["ps_rss_growth_bytes"] = rss1 - rss0
        ctx.serve()
        # memory per stored row: index, row, optimizer state and per-row counters, against the fixed table's
        res["dynamic_bytes_per_row"] = dyn.held_bytes() / max(dyn.shard.index.size, 1)
        res["fixed_bytes_per_row"] = auto.held_bytes() / auto.shard().shape[0]
    else:
        ctx.worker_comm.Barrier()
        # the pulls and the local gather in turns (this VM's speed drifts within a run): the cold
        # table's first pulls between two local gathers, then 5 turns of the warm table
        before = timed(gather, batches)
        res["hpcps_cold_pull"] = timed(cold.pull, batches, warm=False)
        res["cold_ratio"] = res["hpcps_cold_pull"] / np.mean([before, timed(gather, batches)])
        for t in (auto, rma, rma_get):                         # map every page once
            for s in range(0, N, 1 << 16):
                t.pull(np.arange(s, min(N, s + (1 << 16))))
        ctx.worker_comm.Barrier()
        share = max(1, len(batches) // 5)
        warm = [(timed(gather, batches[r * share:(r + 1) * share]), timed(auto.pull, batches[r * share:(r + 1) * share]))
                for r in range(5)]
        res["local_gather"] = float(np.median([g for g, _ in warm]))
        res["hpcps_auto_pull"] = float(np.median([p for _, p in warm]))
        res["warm_ratio"] = float(np.median([p / g for g, p in warm]))
        del local
        res["hpcps_auto_push"] = timed(lambda ids: auto.push(ids, grads), batches)
        ctx.worker_comm.Barrier()
        res["hpcps_rma_pull"] = timed(rma.pull, batches)
        res["hpcps_rma_push"] = timed(lambda ids: rma.push(ids, grads), batches)
        res["hpcps_rma_get_pull"] = timed(rma_get.pull, batches)
        # the dynamic table: N ids spread over all of int64 (as hashed feature keys are: key i
        # is splitmix64(i), a bijection, so distinct) stored first (a push stores them: zero
        # gradients, in sync steps), then pulls and sync steps (pull, push, the step's apply) of
        # each batch's keys against the same batches of the fixed table
        keys = splitmix64(np.arange(N, dtype=np.uint64)).view(np.int64)
        dyn_batches = [keys[b] for b in batches]              # batch i's rows, as keys
        clock = [0]
        zeros = np.zeros((1 << 16, D), np.float32)
        for s in range(0, N, 1 << 16):
            ids = keys[s:s + (1 << 16)]
            ctx.step_begin(clock[0])
            dyn.push(ids, zeros[:ids.size])
            ctx.step_end(clock[0])
            clock[0] += 1
        ctx.fence(clock[0])
        for s in range(0, N, 1 << 16):                         # map every page once, as above
            dyn.pull(keys[s:s + (1 << 16)], insert=False)
        ctx.worker_comm.Barrier()
        # fixed and dynamic in turns, a fifth of the batches at a time: this VM's speed drifts
        # within a run, so each ratio compares neighbours (the median of the rounds' ratios)
        turns = {k: [] for k in ("fixed_pull", "dynamic_pull", "fixed_step", "dynamic_step")}
        share = max(1, len(batches) // 5)
        for r in range(5):
            part = slice(r * share, (r + 1) * share)
            turns["fixed_pull"].append(timed(auto.pull, batches[part]))
            turns["dynamic_pull"].append(timed(dyn.pull, dyn_batches[part]))
        dyn.stats()                 # the PS counts those pulls' uses now, not in the first timed step

        def sync_step(t, ids):
            ctx.step_begin(clock[0])
            t.pull(ids)
            t.push(ids, grads)
            ctx.step_end(clock[0])
            clock[0] += 1
        for r in range(5):
            part = slice(r * share, (r + 1) * share)
            turns["fixed_step"].append(timed(lambda ids: sync_step(auto, ids), batches[part]))
            turns["dynamic_step"].append(timed(lambda ids: sync_step(dyn, ids), dyn_batches[part]))
        for k, v in turns.items():
            res[f"hpcps_{k}"] = float(np.median(v))
        res["dynamic_pull_ratio"] = float(np.median(np.divide(turns["dynamic_pull"], turns["fixed_pull"])))
        res["dynamic_step_ratio"] = float(np.median(np.divide(turns["dynamic_step"], turns["fixed_step"])))
        # the push's share of a step (push, the step's apply, the step protocol): a step's time per
        # row less its pull's, in each turn (a push alone is not comparable: a fixed table with
        # plain SGD adds a push on the worker, a dynamic table's PS applies it)
        push = {k: 1 / (1 / np.array(turns[f"{k}_step"]) - 1 / np.array(turns[f"{k}_pull"])) for k in ("fixed", "dynamic")}
        res["dynamic_push_ratio"] = float(np.median(push["dynamic"] / push["fixed"]))
        res["worker_window_bytes"] = auto.rows.nbytes
    ctx.finalize()                          # PS ranks leave serve() here
    all_res = world.gather(res, root=0)
    if world.Get_rank() != 0:
        return
    workers = [r for r in all_res if "hpcps_auto_pull" in r]
    ps = [r for r in all_res if "ps_table_bytes" in r]
    mean = {k: float(np.mean([w[k] for w in workers])) for k in workers[0]}
    per_row = {k: float(np.mean([p[k] for p in ps])) for k in ("dynamic_bytes_per_row", "fixed_bytes_per_row")}
    row_gb = D * 4 / 1e9
    rates = [k for k in mean if k not in ("worker_window_bytes", "dynamic_pull_ratio", "dynamic_step_ratio",
                                          "dynamic_push_ratio", "warm_ratio", "cold_ratio")]
    report = {
        "mpi": {"library": MPI.get_vendor()[0], "version": ".".join(map(str, MPI.get_vendor()[1])),
                "windows": ctx.window_kind},
        "config": {"rows": N, "dim": D, "batch": B, "iters": args.iters, "num_ps": ctx.num_ps,
                   "num_workers": ctx.num_workers, "mpi": MPI.Get_library_version().splitlines()[0].strip(),
                   "host": platform.node(), "cpus": os.cpu_count(), "hpcps": hpcps.__version__},
        "per_worker_mrows_per_s": {k: v / 1e6 for k, v in mean.items() if k in rates},
        "per_worker_gb_per_s": {k: v * row_gb for k, v in mean.items() if k in rates},
        "ratios": {
            "pull_vs_local_gather": mean["warm_ratio"],
            "pull_cold_vs_local_gather": mean["cold_ratio"],
            "pull_vs_two_sided": mean["hpcps_auto_pull"] / mean["two_sided_pull"],
            "push_vs_local_index_add": mean["hpcps_auto_push"] / mean["local_index_add"],
            "rma_pull_vs_two_sided": mean["hpcps_rma_pull"] / mean["two_sided_pull"],
            "rma_get_accumulate_vs_get": mean["hpcps_rma_pull"] / mean["hpcps_rma_get_pull"],
            "dynamic_pull_vs_fixed": mean["dynamic_pull_ratio"],
            "dynamic_sync_step_vs_fixed": mean["dynamic_step_ratio"],
            "dynamic_push_in_step_vs_fixed": mean["dynamic_push_ratio"],
        },
        "targets": {"pull_vs_local_gather": 0.8, "pull_cold_vs_local_gather": 0.8, "pull_vs_two_sided": 1.5,
                    "push_vs_local_index_add": 0.5,
                    "dynamic_pull_vs_fixed": 0.5, "dynamic_sync_step_vs_fixed": 0.5,
                    "dynamic_push_in_step_vs_fixed": 0.5},
        "memory": {"ps_table_bytes": ps[0]["ps_table_bytes"], "ps_rss_growth_bytes": ps[0]["ps_rss_growth_bytes"],
                   "ps_overhead_fraction": ps[0]["ps_rss_growth_bytes"] / (N / ctx.num_ps * D * 4) - 1,
                   "worker_window_bytes": int(mean["worker_window_bytes"]), **per_row,
                   "dynamic_vs_fixed_bytes_per_row": per_row["dynamic_bytes_per_row"] / per_row["fixed_bytes_per_row"]},
    }
    print(f"sparse bench: {N} x {D} table, batch {B}, {ctx.num_ps} PS, {ctx.num_workers} worker(s), per worker; "
          f"{report['mpi']['library']} {report['mpi']['version']} (windows {ctx.window_kind})")
    for k, v in report["per_worker_mrows_per_s"].items():
        print(f"  {k:22s} {v:8.2f} M rows/s  {report['per_worker_gb_per_s'][k]:6.2f} GB/s")
    for k, v in report["ratios"].items():
        tgt = report["targets"].get(k)
        verdict = "" if tgt is None else (f"  (target >= {tgt}: {'met' if v >= tgt else 'NOT met'})")
        print(f"  {k:28s} {v:6.2f}x{verdict}")
    m = report["memory"]
    print(f"  PS memory: table {m['ps_table_bytes'] / 1e6:.1f} MB, RSS growth {m['ps_rss_growth_bytes'] / 1e6:.1f} MB "
          f"({100 * m['ps_overhead_fraction']:+.2f}%), worker window {m['worker_window_bytes']} bytes")
    print(f"  bytes per row (rows, optimizer state, index): dynamic {m['dynamic_bytes_per_row']:.0f}, "
          f"fixed {m['fixed_bytes_per_row']:.0f} ({m['dynamic_vs_fixed_bytes_per_row']:.2f}x)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"  wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
