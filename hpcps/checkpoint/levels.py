"""Which checkpoint level a restart loads, and the rebuild of a lost host's local files.

Every host's first rank lists the committed parts in its ``local_dir`` (their manifests); the
lists are gathered over the world. A step of the local level is complete when
every PS shard of the job's layout (the same number of PS and the same placement) is in some
host's part, and some host has the dense part. The newest complete step is taken when it is at
least as new as the filesystem's newest verified checkpoint. Then each PS whose host lacks its
shard gets it from a host that has it (its own part elsewhere, or a partner copy), and each host
without a dense part gets one; what arrives is committed as a part on the receiving host, so the
level is whole again.

Only the files a restart reads are checked against their checksums, by the rank that reads or
sends them (a host's first worker the dense file its workers read, a sender what it sends; a
receiver checks what arrives; a PS its shard while it loads it, :mod:`hpcps.checkpoint.readback`):
not every kept part, which at a GB a shard was most of a restart. A file that
fails marks its part bad, and the choice is made again without it (an older step, a partner
copy, or the filesystem level).
"""

import logging
from dataclasses import dataclass
from pathlib import Path

from mpi4py import MPI

from ..core.wait import quiet_barrier
from . import local, store
from .partner import recv_file, send_file
from .shards import shard_file

__all__ = ["LocalFound", "find_local"]

logger = logging.getLogger(__name__)


@dataclass
class LocalFound:
    """A restart from the node-local level: ``path`` (a dense part on this host: its manifest is the
    checkpoint's), ``own`` (a PS: the paths of its shard files on this host, of each step of the
    chain: the full one first), ``step``, ``rebuilt`` (files copied from other hosts, over the job)."""

    path: Path
    own: list | None
    step: int
    rebuilt: int


def _inventory(root) -> list:
    """This host's committed parts whose manifests read: ``[(step, path, shards, dense, manifest
    without files)]`` (their files are checked once chosen: :func:`_check`)."""
    out = []
    for part in local.scan(root, check=False):
        if not part["ok"]:
            logger.warning("hpcps: skipping local checkpoint part %s", part["why"])
            continue
        man = {k: v for k, v in part["manifest"].items() if k != "files"}
        out.append((part["step"], str(part["path"]), list(man.get("shards", [])), bool(man.get("dense")), man))
    return out


def _complete(hosts: dict, num_ps: int, sharding, job_dir: str, bad=frozenset()) -> dict | None:
    """The newest complete step of the job whose ``checkpoint.dir`` is ``job_dir``, without the
    parts ``bad`` (``(host, path)``): a dense part at it, and every PS shard at every step of its
    chain (an incremental part builds on the parts of its ``chain``: a full one, then deltas):
    ``{"step", "chain", "held": {(step, p): [(host, path, manifest)]}, "dense": [...]}``."""
    held, dense, chains = {}, {}, {}
    for host, inv in sorted(hosts.items()):
        for s, path, shards, has_dense, man in inv:
            if (man.get("num_ps") != num_ps or man.get("sharding") != sharding
                    or man.get("checkpoint_dir") != job_dir or (host, path) in bad):
                continue
            for p in shards:
                held.setdefault((s, p), []).append((host, path, man))
            if has_dense:
                dense.setdefault(s, []).append((host, path, man))
                chains.setdefault(s, [int(c) for c in man.get("chain", [s])])
    for step in sorted(dense, reverse=True):
        chain = chains[step]
        if all((c, p) in held for c in chain for p in range(num_ps)):
            return {"step": step, "chain": chain, "held": held, "dense": dense[step]}
    return None


def _plan(ctx, found: dict) -> list:
    """``[(source world rank, source file, destination world rank, shard or None for dense,
    manifest, step)]``: what travels so every PS has its shard of every step of the chain, and
    every host a dense part, on its own host."""
    node = ctx.node_of_rank
    moves = []
    for p, r in enumerate(ctx.ps_world_ranks):
        for c in found["chain"]:
            have = found["held"][(c, p)]
            if not any(host == node[r] for host, _, _ in have):
                host, path, man = have[0]
                moves.append((host, str(Path(path) / shard_file(p)), r, p, man, c))
    host, path, man = found["dense"][0]
    for n in sorted(set(node)):
        if not any(h == n for h, _, _ in found["dense"]):
            moves.append((host, str(Path(path) / "dense.h5"), n, None, man, found["step"]))
    return moves


def _move(ctx, root, moves: list, keep: int, file_mode: int) -> None:
    """Carry out the plan: sources send (node leaders hold the files), destinations write what
    arrives (each file's head names its step and shard) and commit one rebuilt part per step.
    Collective over the world (every rank walks the same plan)."""
    me, world = ctx.rank, ctx.world
    sends = [send_file(world, dst, c, -1 if p is None else p, src_file, local.sidecar(src_file))
             for src, src_file, dst, p, _, c in moves if src == me]
    parts = {}                      # step -> (copy, tmp, shards, dense, manifest fields)
    for src, _, dst, _, man, c in moves:
        if dst != me:
            continue
        step, shard, data, digest = recv_file(world, src)
        if step not in parts:
            copy = local.free_copy(root, step, me)
            tmp = local.part_tmp(root, step, me, copy)
            tmp.mkdir(parents=True, exist_ok=True)
            parts[step] = (copy, tmp, [], [False], dict(man))
        copy, tmp, shards, dense, fields = parts[step]
        local.write_bytes(tmp / ("dense.h5" if shard < 0 else shard_file(shard)), data, digest, file_mode)
        if shard < 0:
            dense[0] = True
            fields.update(man)          # a dense part's manifest: the checkpoint's (config, data plan)
        else:
            shards.append(shard)
    for step, (copy, tmp, shards, dense, fields) in sorted(parts.items()):
        manifest = {**fields, "shards": sorted(shards), "dense": dense[0], "rebuilt": True}
        local.commit_part(root, step, me, manifest, keep, file_mode, copy)
    for reqs, *_ in sends:
        MPI.Request.Waitall(reqs)


def _reads(ctx, found: dict, moves: list) -> list:
    """``[(host, part, file)]``: what this rank sends, and what its host reads (its first worker:
    the dense file the host's workers read), to be checked first."""
    me, node = ctx.rank, ctx.node_of_rank[ctx.rank]
    out = [(src, str(Path(f).parent), Path(f).name) for src, f, *_ in moves if src == me]
    # a PS checks its own file as it loads it (hpcps.checkpoint.readback)
    if ctx.is_worker and me == ctx.node_workers[0]:
        here = [x for x in found["dense"] if x[0] == node]
        if here:
            out.append((here[0][0], here[0][1], "dense.h5"))
    return out


def _check(ctx, found: dict, moves: list) -> set:
    """Every rank checks the files it reads or sends against their parts' checksums; the parts
    that failed anywhere, ``{(host, path)}``. Collective over the world."""
    failed = []
    for host, part, name in _reads(ctx, found, moves):
        ok, why = store.verify(part, only=[name])
        if not ok:
            logger.warning("hpcps: local checkpoint part %s: %s", part, why)
            failed.append((host, part))
    if moves:          # senders hash whole shards: the others sleep meanwhile (a dense file is quick)
        quiet_barrier(ctx.world)
    return {tuple(x) for f in ctx.world.allgather(failed) for x in f}


def find_local(ctx, root, job_dir, sharding, keep: int, file_mode: int, newer_than: int = -1) -> LocalFound | None:
    """The node-local level to restart from, rebuilt where a host lost its files; None when no
    complete step is newer than ``newer_than`` (the filesystem's step). Only parts written by a
    job of the same ``checkpoint.dir`` (``job_dir``) count: another job's parts in the same local
    directory are not this job's state. Collective over the world."""
    lead = ctx.node_comm.Get_rank() == 0
    me = ctx.rank
    inv = _inventory(root) if lead else None    # manifests only: a ms or so (a quiet wait's naps took more)
    hosts = {n: i for n, i in ctx.world.allgather((ctx.node_of_rank[me], inv)) if i is not None}
    bad = set()
    while True:
        found = _complete(hosts, ctx.num_ps, sharding, str(Path(job_dir).resolve()), bad)
        if found is None or found["step"] < newer_than:
            return None
        moves = _plan(ctx, found)
        failed = _check(ctx, found, moves)
        if not failed:
            break
        bad |= failed
    step = found["step"]
    node = ctx.node_of_rank[me]
    if moves:
        _move(ctx, root, moves, keep, file_mode)
        ctx.node_comm.Barrier()                 # every rebuilt part of this host is committed
        good = [(p["step"], p["path"], p["manifest"]) for p in local.scan(root, check=False)]
    else:                                       # this host's parts are as its leader listed them
        good = [(s, Path(path), man) for s, path, _, _, man in hosts.get(node, [])]
    good = [(s, path, man) for s, path, man in good if (node, str(path)) not in bad]
    dense = next(path for s, path, man in good if s == step and man.get("dense"))
    own = None
    if ctx.is_ps:                               # its file of each step of the chain, the full one first
        own = [next(path / shard_file(ctx.ps_rank) for s, path, man in good
                    if s == c and ctx.ps_rank in man.get("shards", [])) for c in found["chain"]]
    return LocalFound(dense, own, step, len(moves))
