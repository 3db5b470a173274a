"""``hpcps plan``: the layout, memory, checkpoint and throughput of a config on N nodes, from
:mod:`hpcps.plan.model`. Local; no MPI launch needed."""

import json
import sys

__all__ = ["add_parser", "run"]

SPREAD_WARN = 0.5       # a timing's median 50% over its fastest: a busy machine (quiet, the gather varies ~5-35%)


def add_parser(sub) -> None:
    """The ``plan`` subcommand's arguments. Local."""
    p = sub.add_parser("plan", help="the PS/worker split, memory, checkpoint time and samples/s of a config on N "
                                    "nodes (a model; no MPI launch needed)",
                       description=("An alpha-beta model of a sync step (pulls, the dense part, pushes, the PS's "
                                    "apply, the dense all-reduce), a checkpoint and a restore, from the config's "
                                    "tables and model and per-row costs timed on this machine, one CPU (its cores "
                                    "taken as fast as the cluster's). Tries PS counts and prints the fastest layout "
                                    "that fits the nodes' memory, the bottleneck by name, and one JSON line "
                                    "{\"plan\": {...}}. Exit 1 when no layout fits. docs/scale.md has its "
                                    "assumptions."))
    p.add_argument("--config", metavar="FILE.toml", help="config file (default: built-in defaults)")
    p.add_argument("--set", metavar="KEY=VALUE", nargs="+", action="extend", default=[], help="as for train")
    p.add_argument("--nodes", type=int, required=True, help="nodes")
    p.add_argument("--cpus-per-node", type=int, default=64, help="CPU cores a node (default 64)")
    p.add_argument("--mem-per-node", type=float, default=512, help="GB of memory a node (default 512)")
    p.add_argument("--ranks-per-node", type=int, default=0, help="MPI ranks a node (default: one per 8 cores)")
    p.add_argument("--net-gbps", type=float, default=200, help="each node's link, Gb/s (default 200: InfiniBand HDR)")
    p.add_argument("--latency-us", type=float, default=2, help="one message or RMA round trip, us (default 2)")
    p.add_argument("--fs-gbps", type=float, default=100, help="the parallel filesystem's aggregate, GB/s (default 100)")
    p.add_argument("--costs", metavar="FILE.json", help="per-row costs saved by --save-costs (default: timed now)")
    p.add_argument("--save-costs", metavar="FILE.json", help="write the costs timed here")


def _gb(x: float) -> str:
    return f"{x / 1e9:,.1f} GB"


def _check_cluster(args) -> None:
    """``ValueError`` naming the first option out of range (a zero bandwidth divides by zero, a
    negative one plans a faster cluster than any). Local."""
    import math
    for name, value, least, strict in (("--nodes", args.nodes, 1, False), ("--cpus-per-node", args.cpus_per_node, 1, False),
                                       ("--ranks-per-node", args.ranks_per_node, 0, False),
                                       ("--mem-per-node", args.mem_per_node, 0, True), ("--net-gbps", args.net_gbps, 0, True),
                                       ("--fs-gbps", args.fs_gbps, 0, True), ("--latency-us", args.latency_us, 0, False)):
        if not math.isfinite(value) or value < least or (strict and value <= least):
            raise ValueError(f"plan: {name} {value:g}: must be {'>' if strict else '>='} {least}")
    if args.ranks_per_node > args.cpus_per_node:
        raise ValueError(f"plan: --ranks-per-node {args.ranks_per_node}: more than --cpus-per-node {args.cpus_per_node}")


def _load_costs(path: str, Costs):
    """The costs a ``--save-costs`` file holds; ``ValueError`` naming the file and what is wrong. Local."""
    import math
    try:
        saved = json.loads(open(path).read())
        costs = Costs(**saved)
    except OSError as e:
        raise ValueError(f"--costs {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--costs {path}: not JSON ({e})") from None
    except TypeError as e:
        raise ValueError(f"--costs {path}: not a file of hpcps plan --save-costs ({e})") from None
    for key, value in costs.to_dict().items():
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 or (
                value == 0 and key not in ("draw_s_per_sample", "spread")):
            raise ValueError(f"--costs {path}: {key} = {value!r}: must be a number > 0")
    return costs


def run(args, cfg) -> int:
    """Print the plan of ``cfg`` for ``args``; 1 when nothing fits. Local."""
    from .costs import Costs, measure          # here: `hpcps --help` and `train` import no torch or MPI for it
    from .model import MEMORY_SHARE, Cluster, search
    from .workload import describe, workload
    _check_cluster(args)
    w = workload(cfg)
    if args.costs:
        costs = _load_costs(args.costs, Costs)
    else:
        costs = measure(cfg)
        if costs.spread > SPREAD_WARN:
            print(f"hpcps: warning: plan: the timings spread by up to {costs.spread:.0%} (median over fastest): "
                  "this machine is busy, and the layout may differ run to run; time on a quiet node (--save-costs) "
                  "and plan with --costs", file=sys.stderr)
    if args.save_costs:
        with open(args.save_costs, "w") as f:
            json.dump(costs.to_dict(), f, indent=1)
    cl = Cluster(args.nodes, args.cpus_per_node, args.mem_per_node * 1e9, args.net_gbps, args.latency_us * 1e-6,
                 args.fs_gbps, args.ranks_per_node)
    best, fewest = search(w, costs, cl)
    print(f"workload: {describe(w)}")
    print(f"cluster: {cl.nodes} nodes x {cl.cpus_per_node} cores, {_gb(cl.mem_per_node)}, {cl.ranks} ranks; "
          f"{cl.net_gbps:g} Gb/s links, {cl.latency_s * 1e6:g} us; filesystem {cl.fs_gbps:g} GB/s")
    print(f"costs (one CPU{', from ' + args.costs if args.costs else ', timed here'}): gather "
          f"{costs.gather_s_per_byte * 1e9:.3f} ns a byte, apply {costs.apply_s_per_row * 1e6:.3f} us a row, dense "
          f"{costs.dense_s_per_sample * 1e3:.3f} ms a sample, draw {costs.draw_s_per_sample * 1e6:.2f} us a sample, "
          f"HDF5 write {costs.write_bytes_s / 1e9:.2f} / read {costs.read_bytes_s / 1e9:.2f} GB/s; timings spread "
          f"{costs.spread:.0%}")
    out = {"nodes": cl.nodes, "ranks": cl.ranks, "costs": costs.to_dict()}
    if best is None:
        need = fewest["node_bytes"]
        print(f"no layout fits: even {fewest['num_ps']} PS need {_gb(need)} a node, over {MEMORY_SHARE:.0%} of "
              f"{_gb(cl.mem_per_node)}; the tables alone are {_gb(w.row_bytes)} (rows and optimizer state) plus "
              f"staging: use more nodes or nodes with more memory", file=sys.stderr)
        print(json.dumps({"plan": {**out, "fits": False, "node_bytes": need}}))
        return 1
    t = best["terms_s"]
    print(f"layout: {best['num_ps']} PS + {best['workers']} workers (--set job.num_ps={best['num_ps']}); "
          f"fewest PS that fit: {fewest['num_ps']}")
    if cl.ranks - 1 > w.batch:
        print(f"note: the global batch ({w.batch}) caps the workers at {w.batch} (a sample each): the "
              f"other ranks can only be PS; a larger data.batch_size puts more nodes to work", file=sys.stderr)
    print(f"memory: {_gb(best['ps_bytes'])} a PS (rows, state, staging, push mailboxes); {_gb(best['node_bytes'])} a node "
          f"of {_gb(cl.mem_per_node)}")
    draw = f"draw {1e3 * t['draw']:.2f} + " if t["draw"] else ""
    print(f"step: {1e3 * best['step_s']:.2f} ms = {draw}pull {1e3 * t['pull']:.2f} + dense {1e3 * t['compute']:.2f} + "
          f"push {1e3 * t['push']:.2f} + max(apply {1e3 * t['apply']:.2f}, all-reduce {1e3 * t['allreduce']:.2f}); "
          f"{best['samples_per_s']:,.0f} samples/s; bottleneck: {best['bottleneck']}")
    print(f"checkpoint: {_gb(best['checkpoint_bytes'])} in {best['checkpoint_s']:.1f} s; restore {best['restore_s']:.1f} s")
    print(json.dumps({"plan": {**out, "fits": True, **best, "fewest_ps": fewest["num_ps"]}}))
    return 0
