"""Checkpoint and restart under a real mpiexec: resharding, kill -9, corruption, disk full, stop requests."""

import json
import os
import random
import shutil
import signal
import time

import h5py
import numpy as np
import pytest

from hpcps.checkpoint import local, store
from mpirun import ROOT, kill_launch, launch_mpi, rank_pid, reap, run_mpi, selected, train_many

TINY = ROOT / "tests" / "configs" / "tiny_ctr.toml"
BASE = ["optimizer.sparse.name=adam", "optimizer.sparse.lr=0.05", "metrics.progress=false"]


def _train(n, sets, **kw):
    return run_mpi(n, ["-m", "hpcps", "train", "--config", TINY, "--set", *BASE, *sets], **kw)


def _final(stdout):
    return [json.loads(l) for l in stdout.splitlines() if l.startswith('{"final"')][-1]["final"]


def _close(a, b, tol=2e-5):
    """Exports equal within float rounding: another number of workers groups the global batch's
    gradient sums otherwise."""
    a, b = np.load(a), np.load(b)
    assert set(a.files) == set(b.files)
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a.files)
    assert worst < tol, worst


def _same(a, b):
    """Bit-equal exports: sync mode is deterministic (job.deterministic = auto), and a restart with
    the same workers, whatever its PS count, placement or table batching, sums each row's gradients
    in the same worker order."""
    a, b = np.load(a), np.load(b)
    assert set(a.files) == set(b.files)
    for k in a.files:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.fixture(scope="module")
def straight(request, tmp_path_factory):
    """The uninterrupted 30-step runs the restarted ones must match (adam; momentum where a
    selected case of HALVES restarts it)."""
    d = tmp_path_factory.mktemp("straight")
    opts = sorted({HALVES[p["case"]][0] if "case" in p else "adam" for p in selected(request)})
    train_many(4, {opt: ["--config", TINY, "--set", *BASE, f"optimizer.sparse.name={opt}", f"job.export={d / opt}.npz"]
                   for opt in opts})
    return {opt: d / f"{opt}.npz" for opt in opts}


HALVES = [
    ("adam", (5, 2), (6, 3), ("true", "true"), ("modulo", "modulo")),           # 2 PS -> 3 PS
    # 3 PS -> 1 PS (momentum buffers and first-step flags move too)
    ("momentum", (5, 3), (3, 1), ("true", "true"), ("modulo", "modulo")),
    # (3 workers -> 2 with 2 PS -> 1: tests/test_hosts.py, after a host is lost)
    # a table per feature -> one table-batched table (model.fuse_tables; and back: the last case)
    ("adam", (5, 2), (4, 1), ("false", "true"), ("modulo", "modulo")),
    # contiguous ranges: 2 PS -> 3 PS under ranges, and ranges over 3 PS -> modulo over 2
    ("adam", (5, 2), (6, 3), ("true", "true"), ("range", "range")),
    ("momentum", (6, 3), (5, 2), ("true", "false"), ("range", "modulo")),
]


@pytest.fixture(scope="module")
def halves(request, tmp_path_factory):
    """Each selected case of HALVES: 15 steps that checkpoint, then a restart with other ranks to step 30.
    The first halves run in one launch per rank count, then the second halves likewise
    (tests/programs/train_many.py). ``(dir, finals, stderr)``: case ``i`` checkpoints in
    ``dir / f"ck{i}"`` and exports ``dir / f"w{i}.npz"``; ``finals[(i, half)]``."""
    d = tmp_path_factory.mktemp("halves")
    finals, stderr = {}, []
    cases = sorted({p["case"] for p in selected(request)})
    for half in (0, 1):
        groups = {}
        for i in cases:
            opt, first, second, fuse, sharding = HALVES[i]
            n, ps = (first, second)[half]
            sets = [f"optimizer.sparse.name={opt}", f"checkpoint.dir={d / f'ck{i}'}", f"job.num_ps={ps}",
                    f"model.fuse_tables={fuse[half]}", f"model.sharding={sharding[half]}"]
            sets += ["job.steps=15"] if half == 0 else [f"job.export={d / f'w{i}.npz'}"]
            groups.setdefault(n, {})[str(i)] = ["--config", TINY, "--set", *BASE, *sets]
        for n, runs in groups.items():
            got = train_many(n, runs, timeout=400)
            finals.update({(int(i), half): got[i][0] for i in runs})
            stderr.append(got[None])
    return d, finals, "".join(stderr)


# the Open MPI leg: 2 PS -> 3 under modulo and under ranges (each a launch of 5 ranks, then of 6)
@pytest.mark.parametrize("case", [pytest.param(i, marks=[pytest.mark.openmpi] if i in (0, 3) else [])
                                  for i in range(len(HALVES))], ids=lambda i: "-".join(
    [HALVES[i][0], *(f"{n}r{p}ps" for n, p in HALVES[i][1:3]), *HALVES[i][4]] + (["fuse" if HALVES[i][3][0] == "true" else "split"])))
def test_half_then_restart_equals_straight(halves, straight, case):
    d, finals, stderr = halves
    opt, first, second, fuse, sharding = HALVES[case]
    ck = d / f"ck{case}"
    f = finals[(case, 0)]
    assert f["checkpoints"] == [15] and f["sharding"] == sharding[0]
    assert store.read_manifest(ck / "step-000000015")["sharding"] == sharding[0]
    f = finals[(case, 1)]
    assert f["start_step"] == 15 and f["steps"] == 30 and f["num_ps"] == second[1]
    assert f["restored_from"] == "pfs" and f"resuming from {ck}/step-000000015" in stderr
    # the straight run has 3 workers: bit-equal when the restart has them too, whatever the PS
    (_same if second[0] - second[1] == 3 else _close)(d / f"w{case}.npz", straight[opt])


KINDS = ("lr", "wide_deep", "deepfm", "dcn")     # DLRM: above; each kind's tables (parts) checkpoint and move


@pytest.fixture(scope="module")
def kinds(tmp_path_factory):
    """Each of KINDS: 30 steps straight, and 15 steps that checkpoint (1 PS, tables fused) then a
    restart to step 30 on 2 PS with a table per feature, the same 3 workers. ``(dir, finals)``:
    kind ``k`` exports ``dir / f"{k}-straight.npz"`` and ``dir / f"{k}-restart.npz"``."""
    d = tmp_path_factory.mktemp("kinds")
    base = ["--config", TINY, "--set", *BASE, "optimizer.wide.name=ftrl", "optimizer.wide.lr=0.1"]
    first = {f"{k}-straight": [*base, f"model.kind={k}", f"job.export={d / k}-straight.npz"] for k in KINDS}
    first.update({f"{k}-half": [*base, f"model.kind={k}", f"checkpoint.dir={d / k}", "job.steps=15"] for k in KINDS})
    got = train_many(4, first, timeout=400)
    finals = {c: got[c][0] for c in first}
    second = {f"{k}-restart": [*base, f"model.kind={k}", f"checkpoint.dir={d / k}", "job.num_ps=2",
                               "model.fuse_tables=false", f"job.export={d / k}-restart.npz"] for k in KINDS}
    got = train_many(5, second, timeout=400)
    finals.update({c: got[c][0] for c in second})
    return d, finals


@pytest.mark.parametrize("kind", KINDS)
def test_each_model_kind_restarts_bit_equal_on_other_ps(kinds, kind):
    d, finals = kinds
    assert finals[f"{kind}-half"]["checkpoints"] == [15]
    f = finals[f"{kind}-restart"]
    assert f["start_step"] == 15 and f["steps"] == 30 and f["num_ps"] == 2
    _same(d / f"{kind}-restart.npz", d / f"{kind}-straight.npz")


def _start_and_wait_for_a_checkpoint(tmp_path, tag, every, delay):
    """Launch the 30-step job checkpointing every ``every`` steps; return once one is committed."""
    ck = tmp_path / "ck"
    argv = ["-m", "hpcps", "train", "--config", TINY, "--set", *BASE, f"checkpoint.dir={ck}",
            f"checkpoint.every_steps={every}", f"job.export={tmp_path / 'w.npz'}", "job.steps=30"]
    proc = launch_mpi(4, argv, env={"HPCPS_STEP_DELAY": str(delay)}, tag=tag)
    deadline = time.time() + 60
    while time.time() < deadline and not store.list_checkpoints(ck):
        time.sleep(0.05)                                     # training is under way
    return argv, proc, ck


@pytest.mark.openmpi
def test_kill_9_during_checkpoint_writes_never_leaves_a_corrupt_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    argv = ["-m", "hpcps", "train", "--config", TINY, "--set", *BASE, f"checkpoint.dir={ck}",
            "checkpoint.every_steps=1", "checkpoint.keep=2", "job.steps=100000", "data.rows_per_table=200000"]
    rng = random.Random(1)
    loads = 0
    for trial in range(8):
        proc = launch_mpi(3, argv, tag=f"ckw-{trial}")
        t0 = time.time()
        while time.time() - t0 < 60 and not list(ck.glob("step-*")):
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 1.0))
        kill_launch(proc)                                    # every rank at once, mid-write or not
        reap(proc)
        for p in store.list_checkpoints(ck):                 # every committed checkpoint verifies
            assert store.verify(p) == (True, "ok"), p
        if trial % 4 == 3:                                    # and a restart loads one
            r = run_mpi(3, argv[:-2] + ["job.steps=1", "data.rows_per_table=200000", "checkpoint.resume=auto",
                                         "checkpoint.every_steps=0"], timeout=120, check=False)
            assert r.returncode == 0, r.stderr[-2000:]
            f = _final(r.stdout)
            loads += f["start_step"] >= 1
    assert loads >= 1


def test_corrupt_newest_falls_back_to_older(tmp_path):
    ck = tmp_path / "ck"
    _train(4, [f"checkpoint.dir={ck}", "checkpoint.every_steps=10", "job.steps=20"])
    newest = store.step_dir(ck, 20)
    shard = newest / "ps-00000.h5"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    r = _train(4, [f"checkpoint.dir={ck}", "job.steps=25"])
    assert "step-000000020" in r.stderr and "SHA-256" in r.stderr
    assert _final(r.stdout)["start_step"] == 10
    r = _train(4, [f"checkpoint.resume={newest}", "job.steps=25"], check=False, timeout=60)
    assert r.returncode != 0 and "does not verify" in r.stderr


def test_disk_full_is_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path):
    import subprocess
    ck = tmp_path / "ck"
    ck.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(ck)], check=True)   # CI runs as root
    try:
        _train(4, [f"checkpoint.dir={ck}", "job.steps=10"])
        before = store.step_dir(ck, 10)
        size = sum(p.stat().st_size for p in before.iterdir())
        assert 75_000 < size < 500_000
        # leave room for half a checkpoint: the next one cannot fit
        st = os.statvfs(ck)
        (ck / "filler").write_bytes(b"\0" * max(st.f_bavail * st.f_frsize - size // 2, 0))
        r = _train(4, [f"checkpoint.dir={ck}", "job.steps=20"], check=False, timeout=120)
        assert r.returncode != 0
        assert "checkpoint at step 20" in r.stderr and "previous checkpoint is intact" in r.stderr
        assert "No space left on device" in r.stderr or "errno = 28" in r.stderr
        assert store.verify(before) == (True, "ok")
        assert (ck / "latest").read_text().strip() == before.name
        assert store.list_checkpoints(ck) == [before]
    finally:
        subprocess.run(["umount", "-l", str(ck)], check=False)


@pytest.mark.parametrize("how", [pytest.param("sigusr1", marks=pytest.mark.openmpi), "stop-file"])
def test_stop_request_checkpoints_and_exits_85(tmp_path, straight, how):
    tag = f"stop-{how}-{os.getpid()}"
    argv, proc, ck = _start_and_wait_for_a_checkpoint(tmp_path, tag, every=5, delay=0.1)
    if how == "sigusr1":
        for rank in range(4):
            pid = rank_pid(tag, rank)
            if pid:
                os.kill(pid, signal.SIGUSR1)
    else:
        ck.mkdir(exist_ok=True)
        (ck / "STOP").write_text("")
    code, out, err = reap(proc, timeout=90)
    assert code == 85, err[-2000:]
    f = _final(out)
    assert f["stopped"] and f["saved"] and 5 <= f["steps"] < 30 and f["checkpoints"][-1] == f["steps"]
    why = "the file" if how == "stop-file" else "a signal"
    assert f"stop requested ({why}" in err and "exiting with code 85" in err, err[-2000:]
    assert not (ck / "STOP").exists()                   # consumed: the next run is not stopped by it
    r = run_mpi(4, argv, timeout=120)
    assert _final(r.stdout)["start_step"] == f["steps"] and "saved" not in _final(r.stdout)
    _same(tmp_path / "w.npz", straight["adam"])


def test_ckpt_tools(tmp_path):
    import subprocess
    import sys
    ck = tmp_path / "ck"
    _train(4, [f"checkpoint.dir={ck}", "checkpoint.every_steps=10", "job.steps=20",
               f"job.export={tmp_path / 'w.npz'}"])
    run = lambda *a: subprocess.run([sys.executable, "-m", "hpcps", "ckpt", *map(str, a)],  # noqa: E731
                                    capture_output=True, text=True)
    ls = run("ls", ck)
    assert ls.returncode == 0 and "step-000000010" in ls.stdout and "* step-000000020" in ls.stdout
    assert run("verify", ck).returncode == 0
    info = json.loads(run("inspect", ck).stdout)
    assert info["step"] == 20 and [t["name"] for t in info["tables"]] == ["embeddings"]   # table-batched:
    assert info["tables"][0]["segments"] == [["cat0", 300], ["cat1", 300], ["cat2", 300]]  # export splits it
    assert run("export", ck, "--out", tmp_path / "e.h5").returncode == 0
    w = np.load(tmp_path / "w.npz")
    with h5py.File(tmp_path / "e.h5", "r") as f:
        for name in ("cat0", "cat1", "cat2"):
            np.testing.assert_array_equal(f[f"tables/{name}/weights"][...], w[f"tables/{name}"])
        np.testing.assert_array_equal(f["dense/top.0.weight"][...], w["dense/top.0.weight"])
    assert run("export", ck, "--out", tmp_path / "e.pt", "--format", "torch").returncode == 0
    import torch
    sd = torch.load(tmp_path / "e.pt")
    assert sd["tables.cat1.weight"].shape == (300, 4)
    assert run("verify", "--deep", ck).returncode == 0
    # a shard forged after writing (1e30 values, and the manifest's checksum re-forged to match)
    shard = store.step_dir(ck, 10) / "ps-00000.h5"
    with h5py.File(shard, "r+") as f:
        f["tables/embeddings/weights"][0, 0] = 1e30
    man = json.loads((store.step_dir(ck, 10) / "manifest.json").read_text())
    man["files"]["ps-00000.h5"] = {"bytes": shard.stat().st_size, "sha256": store.sha256(shard)}
    (store.step_dir(ck, 10) / "manifest.json").write_text(json.dumps(man))
    assert run("verify", store.step_dir(ck, 10)).returncode == 0                  # checksums cannot tell
    deep = run("verify", "--deep", store.step_dir(ck, 10))
    assert deep.returncode == 1 and "tables/embeddings/weights: |value| up to 1e+30" in deep.stdout, deep.stdout
    (store.step_dir(ck, 20) / "dense.h5").write_bytes(b"broken")
    v = run("verify", ck)
    assert v.returncode == 1 and "step-000000020" in v.stdout


def test_time_trigger_keep_and_configured_modes(tmp_path):
    import stat
    ck = tmp_path / "ck"
    r = _train(4, [f"checkpoint.dir={ck}", "checkpoint.every_seconds=0.5", "checkpoint.keep=2", "job.steps=30",
                   "checkpoint.dir_mode=0750", "checkpoint.file_mode=0640"],
               env={"HPCPS_STEP_DELAY": "0.1"})
    newest = store.step_dir(ck, 30)
    assert stat.S_IMODE(newest.stat().st_mode) == 0o750
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in newest.iterdir()} == {
        "ps-00000.h5": 0o640, "dense.h5": 0o640, "manifest.json": 0o640}
    f = _final(r.stdout)
    assert len(f["checkpoints"]) >= 3 and f["checkpoints"][-1] == 30      # timed ones, then the final one
    assert [p.name for p in store.list_checkpoints(ck)] == [f"step-{s:09d}" for s in f["checkpoints"][-2:]]
    with h5py.File(store.step_dir(ck, 30) / "dense.h5", "r") as d:
        assert d["extra/torch_rng"].shape[0] == 3                          # every worker's RNG state
        assert list(d["extra/worker_positions"][...]) == [30, 30, 30]


@pytest.mark.parametrize("n,ps", [(4, 1), (5, 2)])
def test_incremental_checkpoints_restore_bit_identical(tmp_path, n, ps):
    import subprocess
    import sys
    ck = tmp_path / "ck"
    sets = [f"checkpoint.dir={ck}", "checkpoint.every_steps=5", "checkpoint.full_every=3", "checkpoint.keep=2",
            "data.rows_per_table=20000", f"job.num_ps={ps}", "job.transport=" + ("rma" if ps == 2 else "auto")]
    # 2 PS: sync without deterministic sums, so the cut where the workers fence and wait for the
    # PS ranks' copies (deterministic mode cuts before the PS's next apply instead)
    sets += ["job.deterministic=false"] if ps == 2 else []
    r = _train(n, sets + ["job.steps=30", f"job.export={tmp_path / 'w.npz'}"])
    assert _final(r.stdout)["checkpoints"] == [5, 10, 15, 20, 25, 30]
    kinds = {p.name: store.read_manifest(p)["kind"] for p in store.list_checkpoints(ck)}
    # keep=2 keeps 25 and 30 and the full baseline 20 they build on
    assert kinds == {"step-000000020": "full", "step-000000025": "delta", "step-000000030": "delta"}
    full = sum(f.stat().st_size for f in store.step_dir(ck, 20).glob("ps-*.h5"))
    delta = sum(f.stat().st_size for f in store.step_dir(ck, 30).glob("ps-*.h5"))
    assert full > 6 * delta, (full, delta)
    subprocess.run([sys.executable, "-m", "hpcps", "ckpt", "export", str(ck), "--out", str(tmp_path / "e.h5")],
                   check=True, capture_output=True)
    w = np.load(tmp_path / "w.npz")
    with h5py.File(tmp_path / "e.h5", "r") as f:
        for name in ("cat0", "cat1", "cat2"):
            np.testing.assert_array_equal(f[f"tables/{name}/weights"][...], w[f"tables/{name}"])  # bit-identical
    (store.step_dir(ck, 20) / "ps-00000.h5").write_bytes(b"gone")     # break the baseline: the chain fails
    assert not store.verify_chain(store.step_dir(ck, 30))[0]
    assert store.newest_verified(ck, report=lambda m: None) is None


def test_kill_9_mid_epoch_then_fewer_workers_reads_every_line_exactly_once(tmp_path):
    """A streamed epoch (a plain and a gzipped part, as a glob) over 3 workers, a worker killed -9
    after a checkpoint, the rest of the epoch on 2 workers: counted by each sample's number."""
    import gzip
    rng = np.random.default_rng(1)
    rows = [f"{rng.integers(0, 2)},{i},u{i % 17},v{i % 5}" for i in range(1200)]
    (tmp_path / "part-0.csv").write_text("label,sid,u,v\n" + "\n".join(rows[:500]) + "\n")
    with gzip.open(tmp_path / "part-1.csv.gz", "wt") as f:
        f.write("label,sid,u,v\n" + "\n".join(rows[500:]) + "\n")
    (tmp_path / "eval.csv").write_text("label,sid,u,v\n" + "\n".join(rows[:100]) + "\n")
    ck = tmp_path / "ck"
    argv = ["-m", "hpcps", "train", "--config", TINY, "--set", *BASE, "data.format=csv", "job.steps=0",
            "job.epochs=1", f"data.path={tmp_path / 'part-*'}", f"data.eval_path={tmp_path / 'eval.csv'}",
            "data.label=label", "data.dense=sid", "data.reader=stream", "data.shuffle_buffer=100",
            "data.hash_rows=50", f"checkpoint.dir={ck}", "checkpoint.every_steps=4"]
    tag = f"stream-kill-{os.getpid()}"
    proc = launch_mpi(4, argv + [f"data.trace={tmp_path / 'first'}"], env={"HPCPS_STEP_DELAY": "0.1"}, tag=tag)
    deadline = time.time() + 60
    while time.time() < deadline and not store.list_checkpoints(ck):
        time.sleep(0.05)
    time.sleep(random.uniform(0.0, 0.3))
    pid = rank_pid(tag, 1)
    assert pid, "rank not found"
    os.kill(pid, signal.SIGKILL)
    code, _, _ = reap(proc)
    assert code != 0
    r = run_mpi(3, argv + [f"data.trace={tmp_path / 'second'}"], timeout=120)
    f = _final(r.stdout)
    start = f["start_step"]
    assert 0 < start < 25 and f["steps"] == 25 and f["num_workers"] == 2

    def samples(prefix, keep, width):                 # "step sid sid ..." per step; the kill may cut a line
        out = []
        for p in tmp_path.glob(f"{prefix}.*"):
            for line in p.read_text().splitlines():
                step, *xs = line.split()
                if keep(int(step)) and len(xs) == width:
                    out += [int(float(x)) for x in xs]
        return out
    seen = samples("first", lambda s: s < start, 16) + samples("second", lambda s: s >= start, 24)
    assert sorted(seen) == list(range(1200))


@pytest.mark.openmpi
def test_node_local_level_restarts_bit_equal_and_ckpt_ls_shows_it(tmp_path, straight):
    # local checkpoints every 4 steps, the filesystem's only at the end (step 30); that one lost, a
    # restart takes the newest local step (a delta: only the rows changed since step 24, on a full
    # one at step 4 and the deltas between) and ends with the straight run's bits
    import subprocess
    import sys
    ck, loc = tmp_path / "ck", tmp_path / "local"
    sets = [f"checkpoint.dir={ck}", f"checkpoint.local_dir={loc}", "checkpoint.local_every=4",
            "checkpoint.local_full_every=10", f"job.export={tmp_path / 'w.npz'}"]
    f = _final(_train(4, sets).stdout)
    # due every 4 steps; one whose previous one is still written waits a step or more (never the workers)
    done = f["local_checkpoints"]
    assert done[0] == 4 and len(done) >= 4 and min(b - a for a, b in zip(done, done[1:])) >= 4, done
    assert f["checkpoints"] == [30]
    assert [p.name for p in (tmp_path / "local").iterdir()] == [local.job_root(loc, ck).name]   # the job's own
    loc = local.job_root(loc, ck)
    # local_keep=2 keeps the newest two, and the chain they build on (all from step 4)
    assert {p.name.split(".")[0] for p in loc.iterdir()} == {f"step-{s:09d}" for s in done}
    mans = [store.read_manifest(p) for p in loc.iterdir() if p.name.startswith(f"step-{done[-1]:09d}")]
    assert all(m["kind"] == "delta" and m["chain"] == done for m in mans) and len(mans) == 2
    full = [store.read_manifest(p)["files"] for p in loc.iterdir() if p.name.startswith("step-000000004")]
    delta = [m["files"] for m in mans]
    shard = "ps-00000.h5"
    assert max(f[shard]["bytes"] for f in delta if shard in f) < min(f[shard]["bytes"] for f in full if shard in f)
    ls = subprocess.run([sys.executable, "-m", "hpcps", "ckpt", "ls", str(ck)], capture_output=True, text=True)
    assert "node-local level on this host" in ls.stdout and "ps 0" in ls.stdout and "dense" in ls.stdout, ls.stdout
    assert f"delta on 4 (+{len(done) - 2} between)" in ls.stdout and "  full  " in ls.stdout, ls.stdout
    shutil.rmtree(store.step_dir(ck, 30))
    (tmp_path / "w.npz").unlink()
    r = _train(4, sets)
    f = _final(r.stdout)
    assert f["restored_from"] == "local" and f["start_step"] == done[-1] and "node-local level" in r.stderr
    _same(tmp_path / "w.npz", straight["adam"])


def test_a_local_file_failing_its_check_as_the_ps_loads_it_is_set_aside_and_an_older_step_taken(tmp_path, straight):
    # a full node-local checkpoint every 3 (chains of full + 2 deltas); the PS's own file of the
    # newest step flipped: the PS finds it as it loads it (its rows partly overwritten), sets that part
    # aside, and the job loads the step before, still ending with the straight run's bits
    ck, loc = tmp_path / "ck", tmp_path / "local"
    sets = [f"checkpoint.dir={ck}", f"checkpoint.local_dir={loc}", "checkpoint.local_every=4",
            "checkpoint.local_full_every=3", f"job.export={tmp_path / 'w.npz'}"]
    done = _final(_train(4, sets).stdout)["local_checkpoints"]
    loc = local.job_root(loc, ck)                                  # the job's own directory in local_dir
    kinds = {p.name: store.read_manifest(p)["kind"] for p in loc.iterdir()}
    assert "full" in kinds.values() and "delta" in kinds.values(), kinds
    shutil.rmtree(store.step_dir(ck, 30))
    (tmp_path / "w.npz").unlink()
    part = next(p for p in loc.iterdir() if p.name.startswith(f"step-{done[-1]:09d}") and (p / "ps-00000.h5").exists())
    data = bytearray((part / "ps-00000.h5").read_bytes())
    data[len(data) // 2] ^= 0x10
    (part / "ps-00000.h5").write_bytes(bytes(data))
    r = _train(4, sets)
    f = _final(r.stdout)
    assert "CRC-32" in r.stderr and "choosing again" in r.stderr, r.stderr[-3000:]
    assert f["restored_from"] == "local" and f["start_step"] == done[-2]
    assert part.with_name(part.name + ".bad").is_dir()             # kept for a look, out of the way
    assert not part.exists() or store.verify(part) == (True, "ok")  # the run took that step again
    _same(tmp_path / "w.npz", straight["adam"])
