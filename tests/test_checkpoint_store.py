"""Checkpoint directories without MPI: commit, verify, fall back, prune, permissions."""

import json
import os
import stat
import time
from pathlib import Path

import pytest

from hpcps.checkpoint import store


def _make(root, step, payload=b"x" * 1000):
    tmp = store.tmp_dir(root, step)
    tmp.mkdir(parents=True)
    (tmp / "ps-00000.h5").write_bytes(payload)
    (tmp / "dense.h5").write_bytes(b"dense" * 10)
    return store.commit(root, step, {"step": step, "num_ps": 1, "num_workers": 1, "tables": []}, keep=0)


def test_commit_layout_latest_and_modes(tmp_path):
    p = _make(tmp_path, 10)
    assert p == store.step_dir(tmp_path, 10) and p.is_dir() and not store.tmp_dir(tmp_path, 10).exists()
    assert (tmp_path / "latest").read_text().strip() == p.name
    man = json.loads((p / "manifest.json").read_text())
    assert set(man["files"]) == {"ps-00000.h5", "dense.h5"} and man["step"] == 10
    assert store.verify(p) == (True, "ok")
    assert stat.S_IMODE(os.stat(p / "manifest.json").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "latest").st_mode) == 0o600


def test_truncated_and_flipped_files_are_detected_and_older_used(tmp_path):
    _make(tmp_path, 10)
    newest = _make(tmp_path, 20)
    shard = newest / "ps-00000.h5"
    data = bytearray(shard.read_bytes())
    data[500] ^= 0xFF
    shard.write_bytes(bytes(data))
    ok, why = store.verify(newest)
    assert not ok and "SHA-256" in why
    shard.write_bytes(bytes(data[:300]))
    ok, why = store.verify(newest)
    assert not ok and "truncated" in why
    seen = []
    assert store.newest_verified(tmp_path, report=seen.append) == store.step_dir(tmp_path, 10)
    assert len(seen) == 1 and "step-000000020" in seen[0]
    (newest / "dense.h5").unlink()
    assert "missing" in store.verify(newest)[1]
    with pytest.raises(ValueError, match="does not verify"):
        store.resolve(str(newest), tmp_path)
    assert store.resolve("auto", tmp_path) == store.step_dir(tmp_path, 10)
    assert store.resolve("none", tmp_path) is None


def test_own_commits_are_trusted_only_when_asked_and_only_while_unchanged(tmp_path, monkeypatch):
    from hpcps.checkpoint import digest
    hashed = []
    of_file = digest.of_file
    monkeypatch.setattr(digest, "of_file", lambda f, algo: hashed.append(Path(f).name) or of_file(f, algo))
    monkeypatch.setattr(store, "_TRUST_OWN", [False])
    newest = _make(tmp_path, 10)
    hashed.clear()                                                        # commit's own hashing
    assert store.verify(newest) == (True, "ok") and sorted(hashed) == ["dense.h5", "ps-00000.h5"]
    store.trust_own_commits()
    hashed.clear()
    assert store.verify(newest) == (True, "ok") and hashed == []        # committed here, unchanged
    time.sleep(0.05)                                                      # a new modification time
    (newest / "dense.h5").write_bytes(b"DENSE" * 10)                     # same size, other bytes
    ok, why = store.verify(newest)
    assert not ok and "dense.h5" in why and hashed == ["dense.h5"]


def test_uncommitted_tmp_is_ignored_and_cleaned(tmp_path):
    _make(tmp_path, 10)
    store.tmp_dir(tmp_path, 20).mkdir()                    # a write that died before its commit
    assert store.list_checkpoints(tmp_path) == [store.step_dir(tmp_path, 10)]
    _make(tmp_path, 30)
    assert not store.tmp_dir(tmp_path, 20).exists()


def test_prune_only_after_commit_keeps_newest(tmp_path):
    for s in (1, 2, 3):
        _make(tmp_path, s)
    tmp = store.tmp_dir(tmp_path, 4)
    tmp.mkdir()
    (tmp / "dense.h5").write_bytes(b"d")
    store.commit(tmp_path, 4, {"step": 4}, keep=2)
    assert [p.name for p in store.list_checkpoints(tmp_path)] == ["step-000000003", "step-000000004"]


def test_a_checkpoint_a_reader_pinned_is_not_pruned_until_the_reader_is_gone(tmp_path):
    """Issue 51.12: predict of a checkpoint directory while training pruned it died on a missing
    manifest. A reader's pin keeps its checkpoint; a dead reader's pin is dropped."""
    import subprocess
    from hpcps.checkpoint.lock import pin, pinned, unpin
    for s in (1, 2):
        _make(tmp_path, s)
    mine = pin(tmp_path, "step-000000001")
    reader = subprocess.Popen(["sleep", "60"])
    try:                                   # another live process's pin, as a predict job's rank 0 writes it
        theirs = tmp_path / "PINS" / f"{mine.name.rsplit('-', 1)[0]}-{reader.pid}"
        theirs.write_text(json.dumps({**json.loads(mine.read_text()), "pid": reader.pid, "checkpoints": ["step-000000002"]}))
        unpin(mine)
        _stage(tmp_path, 3)
        store.commit(tmp_path, 3, {"step": 3}, keep=1)
        assert [p.name for p in store.list_checkpoints(tmp_path)] == ["step-000000002", "step-000000003"]
    finally:
        reader.kill()
        reader.wait()
    assert pinned(tmp_path) == set() and not theirs.exists()        # its process is gone
    _stage(tmp_path, 4)
    store.commit(tmp_path, 4, {"step": 4}, keep=1)
    assert [p.name for p in store.list_checkpoints(tmp_path)] == ["step-000000004"]


def _stage(root, step) -> None:
    tmp = store.tmp_dir(root, step)
    tmp.mkdir()
    (tmp / "dense.h5").write_bytes(b"d")


def test_a_kill_during_prune_leaves_no_half_deleted_checkpoint(tmp_path, monkeypatch):
    import shutil
    for s in (1, 2):
        _make(tmp_path, s)
    real = shutil.rmtree

    def dies_midway(path, ignore_errors=False):     # removes one file, then the process "dies"
        first = sorted(p for p in __import__("pathlib").Path(path).iterdir())[0]
        first.unlink()
        raise KeyboardInterrupt("killed")
    monkeypatch.setattr(store.shutil, "rmtree", dies_midway)
    tmp = store.tmp_dir(tmp_path, 3)
    tmp.mkdir()
    (tmp / "dense.h5").write_bytes(b"d")
    with pytest.raises(KeyboardInterrupt):
        store.commit(tmp_path, 3, {"step": 3}, keep=1)
    monkeypatch.setattr(store.shutil, "rmtree", real)
    # every checkpoint still listed is whole; the interrupted delete is out of the namespace
    assert [p.name for p in store.list_checkpoints(tmp_path)] == ["step-000000002", "step-000000003"]
    assert all(store.verify(p)[0] for p in store.list_checkpoints(tmp_path)[:1])
    assert (tmp_path / "step-000000001.del").exists()
    _make(tmp_path, 4)                               # the next commit removes the leftover
    assert not (tmp_path / "step-000000001.del").exists()


def test_shard_writer_checks_free_space_first_and_removes_a_failed_file(tmp_path, monkeypatch):
    import errno

    import h5py
    import numpy as np

    from hpcps.checkpoint import shards

    t = {"ids": np.arange(1000), "weights": np.ones((1000, 8), np.float32), "state": {}, "applies": 3,
         "num_rows": 1000, "dim": 8, "optimizer": "SGD"}
    ok = tmp_path / "ok.h5"
    shards.write_shard(ok, 5, 0, 1, {"t": t}, file_mode=0o640)
    assert stat.S_IMODE(os.stat(ok).st_mode) == 0o640
    assert (tmp_path / "ok.h5.sha256").read_text() == store.sha256(ok)
    with h5py.File(ok, "r") as f:
        assert f["tables/t/weights"].shape == (1000, 8) and f.attrs["step"] == 5

    class Tiny:                                     # a filesystem with 10 KB free
        f_bavail, f_frsize = 10, 1024
    monkeypatch.setattr(shards.os, "statvfs", lambda _: Tiny)
    with pytest.raises(OSError, match="No space left on device: .*needs about") as e:
        shards.write_shard(tmp_path / "full.h5", 6, 0, 1, {"t": t})
    assert e.value.errno == errno.ENOSPC and not (tmp_path / "full.h5").exists()
    monkeypatch.undo()

    bad = dict(t, state={"x": object()})            # h5py cannot store it: the write fails midway
    with pytest.raises(OSError, match="writing .*bad.h5 failed"):
        shards.write_shard(tmp_path / "bad.h5", 7, 0, 1, {"t": bad})
    assert not (tmp_path / "bad.h5").exists() and not (tmp_path / "bad.h5.sha256").exists()


def _set_parent(p, parent):
    man = json.loads((p / "manifest.json").read_text())
    man["parent"], man["kind"] = parent, "delta"
    (p / "manifest.json").write_text(json.dumps(man))


@pytest.mark.parametrize("parent", ["self", "newer", "other", 7])
def test_a_manifest_whose_parent_loops_or_is_bogus_is_an_error_not_a_hang(tmp_path, parent):
    old, p = _make(tmp_path, 10), _make(tmp_path, 20)
    name = {"self": p.name, "newer": "step-000000030", "other": "../../etc"}.get(parent, parent)
    if parent == "newer":
        _set_parent(old, p.name)            # 10 -> 20 -> 10: a loop through two checkpoints
        name = old.name
        p, old = old, p
    _set_parent(p, name)
    with pytest.raises(ValueError, match="parent"):
        store.chain(p)
    assert not store.verify_chain(p)[0]
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "hpcps", "ckpt", "ls", str(tmp_path)], capture_output=True, text=True,
                       timeout=60)
    assert "BROKEN" in r.stdout


def test_a_manifest_that_is_not_an_object_is_a_clear_error(tmp_path):
    p = _make(tmp_path, 10)
    (p / "manifest.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        store.read_manifest(p)
    assert not store.verify(p)[0]


def test_a_planted_latest_tmp_symlink_is_replaced_not_followed(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    os.chmod(outside, 0o644)
    root = tmp_path / "ck"
    root.mkdir()
    (root / "latest.tmp").symlink_to(outside)
    p = _make(root, 10)
    assert outside.read_text() == "keep me" and stat.S_IMODE(os.stat(outside).st_mode) == 0o644
    assert (root / "latest").read_text().strip() == p.name and not (root / "latest").is_symlink()


def test_export_refuses_an_output_inside_a_checkpoint(tmp_path):
    from hpcps.checkpoint import tools
    p = _make(tmp_path, 10)
    before = (p / "ps-00000.h5").read_bytes()
    for out in (p / "ps-00000.h5", p / "sub" / "x.h5", store.tmp_dir(tmp_path, 20) / "x.h5"):
        with pytest.raises(ValueError, match="inside checkpoint"):
            tools.export(p, out)
    assert (p / "ps-00000.h5").read_bytes() == before


@pytest.mark.parametrize("field,value", [("files", [1, 2]), ("files", {"ps-00000.h5": 3}), ("step", "10"),
                                         ("num_ps", None), ("tables", {}),
                                         ("files", {"../../etc/passwd": {"bytes": 1, "sha256": "x"}})])
def test_manifest_fields_of_the_wrong_type_fail_verification_with_a_reason(tmp_path, field, value):
    p = _make(tmp_path, 10)
    man = json.loads((p / "manifest.json").read_text())
    man[field] = value
    (p / "manifest.json").write_text(json.dumps(man))
    ok, why = store.verify(p)
    assert not ok and ("manifest" in why), why


def test_inspect_verifies_what_it_shows(tmp_path, capsys):
    from hpcps.checkpoint import tools
    p = _make(tmp_path, 10)
    (p / "ps-00000.h5").write_bytes(b"a foreign file of another size")
    assert tools.inspect(p) == 1
    assert "does not verify" in capsys.readouterr().out


def test_resume_auto_refuses_when_every_checkpoint_fails_and_keeps_them(tmp_path):
    for step in (10, 20):
        p = _make(tmp_path, step)
        (p / "dense.h5").write_bytes(b"flipped")
    with pytest.raises(ValueError, match="no checkpoint in .* verifies .*step-000000020.*checkpoint.resume=none"):
        store.resolve("auto", tmp_path)
    assert store.resolve("none", tmp_path) is None
    assert [p.name for p in store.list_checkpoints(tmp_path)] == ["step-000000010", "step-000000020"]


def test_prune_deletes_only_what_it_may_and_a_same_step_commit_keeps_the_old_aside(tmp_path):
    for step in (10, 20):
        _make(tmp_path, step)
    tmp = store.tmp_dir(tmp_path, 30)
    tmp.mkdir()
    (tmp / "dense.h5").write_bytes(b"new")
    store.commit(tmp_path, 30, {"step": 30, "num_ps": 1, "num_workers": 1, "tables": []}, keep=1,
                 prunable=lambda name: name == "step-000000010")
    assert [p.name for p in store.list_checkpoints(tmp_path)] == ["step-000000020", "step-000000030"]
    tmp = store.tmp_dir(tmp_path, 20)                       # a fresh run reaches step 20 again
    tmp.mkdir()
    (tmp / "dense.h5").write_bytes(b"again")
    store.commit(tmp_path, 20, {"step": 20, "num_ps": 1, "num_workers": 1, "tables": []}, keep=0)
    aside = list(tmp_path.glob("step-000000020.replaced-*"))
    assert len(aside) == 1 and (aside[0] / "ps-00000.h5").exists()


def test_dir_lock_refuses_a_live_holder_and_takes_over_stale_ones(tmp_path, monkeypatch):
    import socket
    import subprocess
    import sys
    from hpcps.checkpoint.lock import STALE_S, DirLock
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = tmp_path / "LOCK"
        live = {"host": socket.gethostname(), "pid": holder.pid, "slurm_job": None, "time": 0}
        lock.write_text(json.dumps(live))
        with pytest.raises(ValueError, match=f"in use by another job: host .*process {holder.pid}"):
            DirLock(tmp_path).acquire()
        monkeypatch.setenv("SLURM_JOB_ID", "77")
        lock.write_text(json.dumps({**live, "slurm_job": "77"}))         # a requeue of the same job
        DirLock(tmp_path).acquire()
        monkeypatch.delenv("SLURM_JOB_ID")
        lock.write_text(json.dumps({**live, "host": "elsewhere"}))
        with pytest.raises(ValueError, match="in use"):
            DirLock(tmp_path).acquire()
        os.utime(lock, (time.time() - STALE_S - 5,) * 2)                  # not refreshed: stale
        d = DirLock(tmp_path)
        d.acquire()
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        d.release()
        assert not lock.exists()
    finally:
        holder.kill()
        holder.wait()
    lock.write_text(json.dumps({**live, "pid": holder.pid}))             # its process is gone
    DirLock(tmp_path).acquire()


def test_node_local_files_carry_crc32_and_a_checked_read_fills_the_tables_memory(tmp_path):
    # the node-local level's checksum (CRC-32) and its one-pass load: every chunk read straight into
    # the array given for it, every byte through the checksum; a flipped byte in a chunk or in HDF5's
    # metadata, or a cut file, is a CorruptFile, never arrays
    import zlib

    import numpy as np

    from hpcps.checkpoint import digest, shards
    from hpcps.checkpoint.readback import CorruptFile, read_checked

    rng = np.random.default_rng(3)
    rows = 70_000                                   # several chunks of CHUNK_ROWS rows
    t = {"ids": np.arange(rows) * 2 + 1, "weights": rng.random((rows, 8), np.float32),
         "state": {"sum": rng.random((rows, 8), np.float32)}, "applies": 9, "num_rows": 2 * rows, "dim": 8,
         "optimizer": "Adagrad"}
    path = tmp_path / "ps-00001.h5"
    shards.write_shard(path, 5, 1, 2, {"t": t}, algo="crc32")
    side = (tmp_path / "ps-00001.h5.crc32").read_text()
    assert side == f"{zlib.crc32(path.read_bytes()):08x}" == digest.of_file(path, "crc32")
    assert not (tmp_path / "ps-00001.h5.sha256").exists()

    into = np.zeros((rows, 8), np.float32)
    got = read_checked(path, f"crc32:{side}", {"tables/t/weights": into})
    assert got["tables/t/weights"] is into
    np.testing.assert_array_equal(into, t["weights"])
    np.testing.assert_array_equal(got["tables/t/state/sum"], t["state"]["sum"])
    np.testing.assert_array_equal(got["tables/t/ids"], t["ids"])
    assert read_checked(path, f"sha256:{store.sha256(path)}")["tables/t/ids"].size == rows

    data = path.read_bytes()
    bad = tmp_path / "bad.h5"
    for at in (len(data) // 2, 200):                # a row's byte; the superblock / object headers
        flipped = bytearray(data)
        flipped[at] ^= 0x04
        bad.write_bytes(bytes(flipped))
        with pytest.raises(CorruptFile, match="CRC-32"):
            read_checked(bad, f"crc32:{side}")
    bad.write_bytes(data[:len(data) - 4096])
    with pytest.raises(CorruptFile):
        read_checked(bad, f"crc32:{side}")

    tmp = store.tmp_dir(tmp_path / "ck", 5)         # a commit takes the writer's CRC-32 into the manifest
    tmp.mkdir(parents=True)
    os.rename(path, tmp / path.name)
    os.rename(tmp_path / "ps-00001.h5.crc32", tmp / "ps-00001.h5.crc32")
    files = store.file_digests(tmp, "crc32")
    assert files == {"ps-00001.h5": {"bytes": len(data), "crc32": side}}


def test_node_local_pruning_waits_for_the_lagging_writer_and_keeps_chains(tmp_path):
    # a host's dense part (rank 0) committed steps ahead of its PS's shard (rank 3), whose writes
    # queue behind a large full one: pruning counts only steps both committed, keeps the newer ones
    # as still written, and the steps a kept delta builds on; a kill's .tmp goes once its writer
    # committed a later step
    from hpcps.checkpoint import local

    def commit(step, rank, chain):
        tmp = local.part_tmp(tmp_path, step, rank)
        tmp.mkdir(parents=True)
        (tmp / ("dense.h5" if rank == 0 else "ps-00000.h5")).write_bytes(b"x" * 64)
        local.commit_part(tmp_path, step, rank, {"step": step, "checkpoint_dir": "/job", "chain": chain}, keep=2,
                          writers=[0, 3])

    def steps():
        return sorted({p["step"] for p in local.scan(tmp_path, check=False)})

    chains = {10: [10], 20: [10, 20], 30: [10, 20, 30], 40: [40], 50: [40, 50], 60: [40, 50, 60]}
    for s in (10, 20, 30, 40, 50, 60):
        commit(s, 0, chains[s])                      # the dense parts run ahead
    commit(10, 3, chains[10])
    assert steps() == [10, 20, 30, 40, 50, 60]      # only step 10 is whole here: all kept
    local.part_tmp(tmp_path, 20, 3).mkdir()          # rank 3's unfinished parts at 15 and 20 (a kill)
    local.part_tmp(tmp_path, 15, 3).mkdir()
    commit(40, 3, chains[40])                        # (it writes in order: they are abandoned)
    assert not local.part_tmp(tmp_path, 15, 3).exists() and not local.part_tmp(tmp_path, 20, 3).exists()
    assert steps() == [10, 40, 50, 60]               # whole: 10 and 40 (kept); 50, 60 still written
    commit(50, 3, chains[50])
    commit(60, 3, chains[60])
    assert steps() == [40, 50, 60]                   # the newest two whole steps, and 40 under them


def test_a_manifest_step_edited_by_hand_fails_verification_and_an_older_one_is_taken(tmp_path, capsys):
    from hpcps.checkpoint import tools
    _make(tmp_path, 10)
    p = _make(tmp_path, 100)
    man = json.loads((p / "manifest.json").read_text())
    man["step"] = 110
    (p / "manifest.json").write_text(json.dumps(man))
    ok, why = store.verify(p)
    assert not ok and "the manifest says step 110, its directory step 100" in why
    assert store.resolve("auto", tmp_path) == store.step_dir(tmp_path, 10)
    assert tools.verify_cmd(p, False, 1e6) == 1
    assert capsys.readouterr().out.count("step-000000100") == 1          # named once, not twice


def test_a_planted_step_tmp_symlink_is_unlinked_never_followed(tmp_path):
    target = tmp_path / "precious"
    target.mkdir()
    (target / "f").write_text("keep")
    root = tmp_path / "ck"
    root.mkdir()
    link = store.tmp_dir(root, 20)
    link.symlink_to(target)
    store.remove_tree(link)                                  # what a checkpoint of step 20 does first
    assert not link.is_symlink() and (target / "f").read_text() == "keep"
    link.symlink_to(target)
    _make(root, 30)                                          # a commit's clean-up of stale .tmp entries
    assert not link.is_symlink() and (target / "f").read_text() == "keep"
    with pytest.raises(OSError, match=f"cannot remove {tmp_path / 'none'}"):
        store.remove_tree(tmp_path / "none")
