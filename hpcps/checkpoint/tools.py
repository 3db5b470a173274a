"""``hpcps ckpt ls|verify|inspect|export``: look at checkpoints without a job. Local."""

import json
from pathlib import Path

import h5py
import numpy as np

from ..core.sharding import logical_tables
from . import local, store
from .dynamic import replay
from .shards import read_dense, shard_file

__all__ = ["ls", "verify_cmd", "inspect", "export", "weights", "pick"]


def pick(path, verify: bool = True) -> Path:
    """A checkpoint, a directory of them meaning its newest verified one, or ``DIR/best`` (the
    best evaluation's, ``checkpoint.keep_best``); with ``verify``, one that does not verify (with
    what it builds on) is a ``ValueError`` saying why, before anything reads it. Local."""
    p = Path(path)
    if p.name == "best" and p.is_file():
        best = store.read_best(p.parent)
        if best is None:
            raise ValueError(f"{path}: names no checkpoint that still exists")
        p = Path(best["path"])
    elif not (p / store.MANIFEST).exists():
        found = store.newest_verified(p, report=lambda m: print(m))
        if found is None:
            raise ValueError(f"no verified checkpoint at {path}")
        return found
    ok, why = store.verify_chain(p) if verify else (True, "")
    if not ok:
        raise ValueError(f"does not verify: {why}")
    return p


def _exists(path) -> None:
    if not Path(path).exists():
        raise ValueError(f"{path}: no such file or directory")


def ls(root, local_dir=None) -> int:
    """Print the checkpoints of ``root`` (the filesystem level), then this host's parts of the
    node-local level (``local_dir``, default the newest checkpoint's ``checkpoint.local_dir``).
    Returns 1 when there is none at all. Local."""
    _exists(root)
    if not Path(root).is_dir():
        raise ValueError(f"{root}: not a directory (ckpt ls lists a checkpoint directory)")
    rows = store.list_checkpoints(root)
    if local_dir is None and rows:
        try:
            local_dir = store.read_manifest(rows[-1]).get("config", {}).get("checkpoint", {}).get("local_dir") or None
        except (OSError, ValueError):
            local_dir = None
    if local_dir is not None:
        local_dir = local.job_root(local_dir, root)          # this job's own parts there
    if not rows:
        print(f"no checkpoints in {root}")
        return 0 if local_dir and _ls_local(root, local_dir) else 1
    latest = (Path(root) / "latest").read_text().strip() if (Path(root) / "latest").exists() else ""
    print(f"filesystem level ({root}; * the newest committed, `latest`; a restart takes the newest that verifies):")
    best = store.read_best(root)
    for p in rows:
        ok, why = store.verify_chain(p)
        try:
            man = store.read_manifest(p)
            size = sum(f["bytes"] for f in man["files"].values())
            desc = (f"step {man['step']:>9}  {man.get('kind', 'full'):5}  {man['num_ps']} PS  "
                    f"{man['num_workers']} workers  {size / 1e6:9.2f} MB")
        except (OSError, ValueError, KeyError):
            desc = "(no manifest)"
        mark = "*" if p.name == latest else " "
        if best is not None and p.name == best["checkpoint"]:
            desc += f"  best {best['metric']} {best['value']:.5g}"
        print(f"{mark} {p.name}  {desc}  {'verified' if ok else 'BROKEN (a restart skips it): ' + why}")
    if local_dir:
        _ls_local(root, local_dir)
    return 0


def _ls_local(root, local_dir) -> int:
    """Print this host's node-local parts of the job of checkpoint directory ``root``, a line per
    step; returns how many steps. Local."""
    job = str(Path(root).resolve())
    parts = [p for p in local.scan(local_dir) if p["manifest"].get("checkpoint_dir") in (job, None)]
    steps = sorted({p["step"] for p in parts})
    print(f"node-local level on this host ({local_dir}): " + ("none" if not steps else f"{len(steps)} step(s)"))
    for step in steps:
        mine = [p for p in parts if p["step"] == step]
        desc = []
        for p in mine:
            man = p["manifest"]
            what = ([f"ps {','.join(map(str, man.get('shards', [])))}"] if man.get("shards") else []) + \
                   (["dense"] if man.get("dense") else [])
            size = sum(f.get("bytes", 0) for f in man.get("files", {}).values())
            desc.append(f"{p['path'].name.split('.', 1)[1]} ({' + '.join(what) or 'empty'}, {size / 1e6:.2f} MB"
                        f"{', rebuilt' if man.get('rebuilt') else ''}{'' if p['ok'] else ', BROKEN: ' + p['why']})")
        num_ps = next((p["manifest"].get("num_ps") for p in mine if p["manifest"].get("num_ps")), "?")
        chain = next((p["manifest"].get("chain") for p in mine if p["manifest"].get("chain")), [step])
        kind = "full" if len(chain) <= 1 else f"delta on {chain[0]} (+{len(chain) - 2} between)"
        print(f"  step {step:>9}  {num_ps} PS  {kind}  parts: {'; '.join(desc)}")
    return len(steps)


def _deep(p: Path, max_abs: float) -> str:
    """Every array of checkpoint ``p`` (weights, optimizer state, dense tensors) finite and within
    ``max_abs``: "" if so, else what is not. A checksum cannot tell a forged file. Local."""
    problems = []

    def look(name, arr):
        a = np.asarray(arr)
        if a.dtype.kind != "f" or a.size == 0:
            return
        bad = int(np.count_nonzero(~np.isfinite(a)))
        top = float(np.nanmax(np.abs(np.where(np.isfinite(a), a, 0))))
        if bad:
            problems.append(f"{name}: {bad} non-finite value(s)")
        if top > max_abs:
            problems.append(f"{name}: |value| up to {top:.3g} (> {max_abs:g})")

    for f in sorted(p.glob("ps-*.h5")):
        with h5py.File(f, "r", locking=False) as h:
            h.visititems(lambda name, obj: look(f"{f.name}:{name}", obj[...]) if isinstance(obj, h5py.Dataset) else None)
    model, _, _ = read_dense(p / "dense.h5")
    for k, v in model.items():
        look(f"dense.h5:{k}", v)
    return "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")


def verify_cmd(path, deep: bool = False, max_abs: float = 1e6) -> int:
    p = Path(path)
    _exists(p)
    targets = [p] if (p / store.MANIFEST).exists() else store.list_checkpoints(p)
    if not targets:
        print(f"no checkpoints at {path}")
        return 1
    bad = 0
    for t in targets:
        ok, why = store.verify_chain(t)
        if ok and deep:
            found = _deep(t, max_abs)
            ok, why = not found, f"{t.name}: values: {found}"
        print(f"{t.name}: ok" if ok else why)                 # why names the checkpoint
        bad += not ok
    return 1 if bad else 0


def inspect(path) -> int:
    p = pick(path, verify=False)
    ok, why = store.verify_chain(p)
    if not ok:
        print(f"hpcps: {p} does not verify: {why}")
        return 1
    man = store.read_manifest(p)
    out = {"path": str(p), "step": man["step"], "kind": man.get("kind", "full"), "base": man.get("base"),
           "num_ps": man["num_ps"], "num_workers": man["num_workers"],
           "sharding": man["sharding"], "versions": man["versions"],
           "tables": man["tables"], "files": {k: v["bytes"] for k, v in man["files"].items()}}
    model, _, _ = read_dense(p / "dense.h5")
    out["dense"] = {k: list(np.shape(v)) for k, v in model.items()}
    print(json.dumps(out, indent=1))
    return 0


def _gather_dynamic(p, man) -> dict:
    """``{name: (ids sorted, their rows)}`` of the checkpoint's dynamic tables."""
    links = [[link / shard_file(ps) for ps in range(store.read_manifest(link)["num_ps"])] for link in store.chain(p)]
    out = {}
    for spec in man["tables"]:
        if spec.get("dynamic"):
            rows = replay(links, spec["name"], [], 0, 1)[0]
            order = np.argsort(rows["ids"])
            out[spec["name"]] = (rows["ids"][order], rows["weights"][order])
    return out


def _gather_tables(p, man):
    tables = {}
    for spec in man["tables"]:
        if not spec.get("dynamic"):
            tables[spec["name"]] = np.zeros((spec["num_rows"], spec["dim"]), np.float32)
    for link in store.chain(p):                  # full baseline, then incremental ones in order
        lm = store.read_manifest(link)
        for ps in range(lm["num_ps"]):
            with h5py.File(link / shard_file(ps), "r", locking=False) as f:
                for name, arr in tables.items():
                    g = f[f"tables/{name}"]
                    arr[g["ids"][...]] = g["weights"][...]
    return {name: tables[spec["name"]][first:first + n]     # a table-batched table: its logical tables, apart
            for spec in man["tables"] if not spec.get("dynamic")
            for name, first, n in logical_tables(spec["name"], spec["num_rows"], spec.get("segments"))}


def weights(path) -> dict:
    """A checkpoint's weights as ``hpcps train``'s ``job.export`` writes them:
    ``{"tables/<name>": rows in global-id order, "dense/<key>": array}``; a dynamic table's as
    ``"tables/<name>"`` (rows) and ``"ids/<name>"`` (their ids, sorted). Local."""
    p = Path(path)
    man = store.read_manifest(p)
    arrays = {f"tables/{k}": v for k, v in _gather_tables(p, man).items()}
    for k, (ids, rows) in _gather_dynamic(p, man).items():
        arrays[f"tables/{k}"], arrays[f"ids/{k}"] = rows, ids
    model, _, _ = read_dense(p / "dense.h5")
    arrays.update({f"dense/{k}": np.asarray(v) for k, v in model.items()})
    return arrays


def export(path, out, fmt: str = "h5") -> int:
    """One file: ``tables/<name>/weights`` [num_rows, dim] in global-id order (a table-batched
    table as its logical tables; a dynamic table's stored rows, with ``tables/<name>/ids``, sorted)
    and ``dense/<name>``; or a torch state dict of the same (``tables.<name>.weight``,
    ``tables.<name>.ids``)."""
    p = pick(path)
    inside = store.inside_checkpoint(out)
    if inside is not None:
        raise ValueError(f"--out {out} is inside checkpoint {inside}: export writes a new file, never into a "
                         f"checkpoint; choose a path outside it")
    man = store.read_manifest(p)
    tables = _gather_tables(p, man)
    dynamic = _gather_dynamic(p, man)
    model, _, _ = read_dense(p / "dense.h5")
    if fmt == "torch":
        import torch
        sd = {f"tables.{k}.weight": torch.from_numpy(v) for k, v in tables.items()}
        for k, (ids, rows) in dynamic.items():
            sd[f"tables.{k}.weight"], sd[f"tables.{k}.ids"] = torch.from_numpy(rows), torch.from_numpy(ids)
        sd.update({k: torch.from_numpy(np.asarray(v)) for k, v in model.items()})
        torch.save(sd, out)
    else:
        with h5py.File(out, "w", locking=False) as f:
            f.attrs.update({"step": man["step"], "source": str(p)})
            for k, v in tables.items():
                f.create_dataset(f"tables/{k}/weights", data=v)
            for k, (ids, rows) in dynamic.items():
                f.create_dataset(f"tables/{k}/ids", data=ids)
                f.create_dataset(f"tables/{k}/weights", data=rows)
            for k, v in model.items():
                f.create_dataset(f"dense/{k}", data=v)
    print(f"exported {p.name} (step {man['step']}) to {out}")
    return 0
