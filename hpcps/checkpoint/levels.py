"""Which checkpoint level a restart loads, and the rebuild of a lost host's local files.

Every host's first rank lists the committed parts in its ``local_dir`` (each verified against its
checksums); the lists are gathered over the world. A step of the local level is complete when
every PS shard of the job's layout (the same number of PS and the same placement) is in some
host's part, and some host has the dense part. The newest complete step is taken when it is at
least as new as the filesystem's newest verified checkpoint. Then each PS whose host lacks its
shard gets it from a host that has it (its own part elsewhere, or a partner copy), and each host
without a dense part gets one; what arrives is committed as a part on the receiving host, so the
level is whole again.
"""

import logging
from dataclasses import dataclass
from pathlib import Path

from mpi4py import MPI

from . import local
from .partner import recv_file, send_file
from .shards import shard_file

__all__ = ["LocalFound", "find_local"]

logger = logging.getLogger(__name__)


@dataclass
class LocalFound:
    """A restart from the node-local level: ``path`` (a dense part on this host: its manifest is the
    checkpoint's), ``own`` (a PS: the path of its shard file on this host), ``step``,
    ``rebuilt`` (files copied from other hosts, over the job)."""

    path: Path
    own: Path | None
    step: int
    rebuilt: int


def _inventory(root) -> list:
    """This host's verified parts: ``[(step, path, shards, dense, manifest without files)]``."""
    out = []
    for part in local.scan(root):
        if not part["ok"]:
            logger.warning("hpcps: skipping local checkpoint part %s", part["why"])
            continue
        man = {k: v for k, v in part["manifest"].items() if k != "files"}
        out.append((part["step"], str(part["path"]), list(man.get("shards", [])), bool(man.get("dense")), man))
    return out


def _complete(hosts: dict, num_ps: int, sharding, job_dir: str) -> dict | None:
    """The newest complete step of the job whose ``checkpoint.dir`` is ``job_dir``:
    ``{"step", "shards": {p: [(host, path, manifest)]}, "dense": [...]}``."""
    steps = sorted({s for inv in hosts.values() for s, *_ in inv}, reverse=True)
    for step in steps:
        shards, dense = {}, []
        for host, inv in sorted(hosts.items()):
            for s, path, held, has_dense, man in inv:
                if (s != step or man.get("num_ps") != num_ps or man.get("sharding") != sharding
                        or man.get("checkpoint_dir") != job_dir):
                    continue
                for p in held:
                    shards.setdefault(p, []).append((host, path, man))
                if has_dense:
                    dense.append((host, path, man))
        if dense and all(p in shards for p in range(num_ps)):
            return {"step": step, "shards": shards, "dense": dense}
    return None


def _plan(ctx, found: dict) -> list:
    """``[(source world rank, source file, destination world rank, shard or None for dense, manifest)]``:
    what travels so every PS has its shard and every host a dense part on its own host."""
    node = ctx.node_of_rank
    moves = []
    for p, r in enumerate(ctx.ps_world_ranks):
        have = found["shards"][p]
        if not any(host == node[r] for host, _, _ in have):
            host, path, man = have[0]
            moves.append((host, str(Path(path) / shard_file(p)), r, p, man))
    host, path, man = found["dense"][0]
    for n in sorted(set(node)):
        if not any(h == n for h, _, _ in found["dense"]):
            moves.append((host, str(Path(path) / "dense.h5"), n, None, man))
    return moves


def _move(ctx, root, step: int, moves: list, keep: int, file_mode: int) -> None:
    """Carry out the plan: sources send (node leaders hold the files), destinations write and
    commit one rebuilt part each. Collective over the world (every rank walks the same plan)."""
    me, world = ctx.rank, ctx.world
    sends = [send_file(world, dst, step, -1 if p is None else p, src_file, _digest(src_file))
             for src, src_file, dst, p, _ in moves if src == me]
    mine = [(src, p, man) for src, _, dst, p, man in moves if dst == me]
    if mine:
        copy = local.free_copy(root, step, me)
        tmp = local.part_tmp(root, step, me, copy)
        tmp.mkdir(parents=True, exist_ok=True)
        shards, fields = [], {}
        for src, p, man in mine:
            _, shard, data, digest = recv_file(world, src)
            name = "dense.h5" if p is None else shard_file(p)
            local.write_bytes(tmp / name, data, digest, file_mode)
            if p is None:
                fields = man
            else:
                shards.append(p)
                fields = fields or man
        manifest = {**fields, "shards": sorted(shards), "dense": any(p is None for _, p, _ in mine), "rebuilt": True}
        local.commit_part(root, step, me, manifest, keep, file_mode, copy)
    for reqs, *_ in sends:
        MPI.Request.Waitall(reqs)


def _digest(path) -> str:
    side = Path(f"{path}.sha256")
    if side.exists():
        return side.read_text().strip()
    from .store import read_manifest
    return read_manifest(Path(path).parent)["files"][Path(path).name]["sha256"]


def find_local(ctx, root, job_dir, sharding, keep: int, file_mode: int, newer_than: int = -1) -> LocalFound | None:
    """The node-local level to restart from, rebuilt where a host lost its files; None when no
    complete step is newer than ``newer_than`` (the filesystem's step). Only parts written by a
    job of the same ``checkpoint.dir`` (``job_dir``) count: another job's parts in the same local
    directory are not this job's state. Collective over the world."""
    lead = ctx.node_comm.Get_rank() == 0
    me = ctx.rank
    inv = _inventory(root) if lead else None
    hosts = {n: i for n, i in ctx.world.allgather((ctx.node_of_rank[me], inv)) if i is not None}
    found = _complete(hosts, ctx.num_ps, sharding, str(Path(job_dir).resolve()))
    if found is None or found["step"] < newer_than:
        return None
    step = found["step"]
    moves = _plan(ctx, found)
    _move(ctx, root, step, moves, keep, file_mode)
    ctx.node_comm.Barrier()                     # every rebuilt part of this host is committed
    parts = [p for p in local.scan(root, check=False) if p["step"] == step]
    dense = next(p["path"] for p in parts if p["manifest"].get("dense"))
    own = None
    if ctx.is_ps:
        own = next(p["path"] / shard_file(ctx.ps_rank) for p in parts if ctx.ps_rank in p["manifest"].get("shards", []))
    return LocalFound(dense, own, step, len(moves))
