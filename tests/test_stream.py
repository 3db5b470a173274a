"""Streamed delimited input: the CSV reader, epoch plans, exact positions across restarts with other
worker counts, bad input, bounded memory. Local (no MPI); the kill -9 count is in test_train_mpi.py."""

import gzip
import itertools
import subprocess
import sys

import numpy as np
import pytest

from hpcps.config import load_config
from hpcps.data import BadLine, make_data
from hpcps.data.plan import fresh_plan, replan, stream_ranges, window_order
from mpirun import ROOT


def _csv(tmp_path, n=1000, parts=2, gz=(1,)):
    """``n`` rows ``label,sid,site,app`` (sid = the row's number) in ``parts`` files, a glob."""
    rng = np.random.default_rng(0)
    bounds = np.linspace(0, n, parts + 1).astype(int)
    for p in range(parts):
        rows = [f"{rng.integers(0, 2)},{i},s{i % 7},a{i % 13}" for i in range(bounds[p], bounds[p + 1])]
        text = "label,sid,site,app\n" + "\n".join(rows) + "\n"
        name = tmp_path / f"part-{p}.csv{'.gz' if p in gz else ''}"
        if p in gz:
            with gzip.open(name, "wt") as f:
                f.write(text)
        else:
            name.write_text(text)
    return str(tmp_path / "part-*")


def _data(spec, workers, worker, *sets):
    cfg = load_config(None, ["data.format=csv", f"data.path={spec}", "data.label=label", "data.dense=sid",
                             "data.batch_size=40", "data.eval_fraction=0", "job.epochs=1", "data.reader=stream",
                             "data.shuffle_buffer=64", *sets], environ={})
    return make_data(cfg.data, 5, workers, worker)


def _sids(batch):
    return batch.dense[:, 0].astype(np.int64).tolist()


def _taken(plan, w, s0, s1, window, seed):
    """Stream positions worker ``w`` of ``plan`` takes in steps [s0, s1), window order included."""
    out = []
    for q in range((s0 - plan.step0) * plan.take(w), (s1 - plan.step0) * plan.take(w)):
        j, i = divmod(q, window)
        n = min(window, plan.share_len(w) - j * window)
        (a, _), = stream_ranges(plan.pieces[w], *(2 * [j * window + int(window_order(seed, plan, w, j, n)[i])]
                                                  + np.array([0, 1])))
        out.append(a)
    return out


def test_replan_leaves_no_position_twice_or_out():
    steps, batch, window = 13, 12, 10
    for w0, w1, step in itertools.product((1, 2, 3), (1, 2, 5), (0, 1, 7, 12)):
        plan = fresh_plan(0, steps, batch, w0)
        seen = sum((_taken(plan, w, 0, step, window, 3) for w in range(w0)), [])
        new = replan(plan, step, steps, w1, window, 3)
        seen += sum((_taken(new, v, step, steps, window, 3) for v in range(w1)), [])
        assert sorted(seen) == list(range(steps * batch)), (w0, w1, step)
        again = replan(new, step + 1, steps, w0, window, 3) if step < 12 else None   # and back
        if again is not None:
            seen = sum((_taken(plan, w, 0, step, window, 3) for w in range(w0)), [])
            seen += sum((_taken(new, v, step, step + 1, window, 3) for v in range(w1)), [])
            seen += sum((_taken(again, w, step + 1, steps, window, 3) for w in range(w0)), [])
            assert sorted(seen) == list(range(steps * batch)), (w0, w1, step, "back")


def test_a_streamed_epoch_fills_its_last_batch_from_its_start_and_leaves_no_line_out(tmp_path):
    """1000 lines in batches of 48: 21 steps an epoch, the last one full with 8 of the epoch's
    first lines again; every line is read in the epoch, by 2 workers as by 1."""
    spec = _csv(tmp_path)
    for workers in (1, 2):
        parts = [_data(spec, workers, w, "data.batch_size=48") for w in range(workers)]
        assert parts[0].steps_per_epoch == 21
        epoch = [sum((_sids(d.train_batch(s)) for d in parts), []) for s in range(21)]
        assert all(len(b) == 48 for b in epoch)
        seen = sum(epoch, [])
        assert sorted(set(seen)) == list(range(1000)) and len(seen) == 1008


def test_an_epoch_reads_every_line_once_and_a_restart_with_other_workers_goes_on(tmp_path):
    spec = _csv(tmp_path)                                # one plain part, one gzipped, as a glob
    two = [_data(spec, 2, w) for w in range(2)]
    assert two[0].steps_per_epoch == 25 and two[0].tables == [("site", 100_000), ("app", 100_000)]
    straight = [sum((_sids(d.train_batch(s)) for d in two), []) for s in range(50)]
    assert sorted(sum(straight[:25], [])) == list(range(1000))        # epoch 0: each line once
    assert sorted(sum(straight[25:], [])) == list(range(1000))        # epoch 1 too, in another order
    assert straight[:25] != straight[25:] and straight[0] != list(range(40))
    state = two[0].state(10)                       # a checkpoint after 10 steps, then 3 workers
    three = [_data(spec, 3, w) for w in range(3)]
    for d in three:
        d.resume(state, 10)
    rest = [sum((_sids(d.train_batch(s)) for d in three), []) for s in range(10, 25)]
    assert sorted(sum(straight[:10] + rest, [])) == list(range(1000))
    again = [_data(spec, 2, w) for w in range(2)]  # the same workers: the very same batches
    for d in again:
        d.resume(state, 10)
    assert [sum((_sids(d.train_batch(s)) for d in again), []) for s in range(10, 25)] == straight[10:25]
    one = _data(spec, 1, 0, "data.shuffle_files=false", "data.shuffle_buffer=1")
    assert _sids(one.train_batch(0)) == list(range(40))      # no shuffling: the files' order


def test_csv_header_label_drop_rest_and_raw_keys(tmp_path):
    f = tmp_path / "avazu.csv"
    f.write_text("id,click,hour,site_id,C1\n" + "".join(f"{10**19 + i},{i % 2},1410{i % 24:02d},s{i % 5},{i % 3}\n"
                                                        for i in range(60)))
    sets = ["data.format=csv", f"data.path={f}", "data.label=click", "data.drop=id", "data.batch_size=20",
            "data.eval_fraction=0", "job.epochs=1", "data.hash_rows=1000"]
    d = make_data(load_config(None, sets, environ={}).data, 0, 1, 0)
    assert [t for t, _ in d.tables] == ["hour", "site_id", "C1"] and d.num_dense == 0
    assert d.stats["train_samples"] == 60 and d.stats["reader"] == "memory"
    raw = make_data(load_config(None, sets + ["data.keys=raw", "data.categorical=C1"], environ={}).data, 0, 1, 0)
    b = raw.train_batch(0)
    assert raw.tables == [("C1", 1000)] and set(b.sparse[0].tolist()) <= {0, 1, 2}
    by_number = make_data(load_config(None, sets[:2] + ["data.label=1", "data.drop=0", "data.header=true"] + sets[4:],
                                      environ={}).data, 0, 1, 0)
    np.testing.assert_array_equal(by_number.train_batch(0).sparse[1], d.train_batch(0).sparse[1])
    from hpcps.data.hashing import binary_buffers, column_key, hash_keys
    import pyarrow as pa
    values = [b"s1", b"", b"a longer value, 27 bytes.."]
    h = hash_keys(*binary_buffers(pa.array(values, pa.binary()).slice(0)), column_key(3))
    assert h.tolist() == [_reference_hash(v, int(column_key(3))) for v in values]   # the hash is a data format


def _reference_hash(value: bytes, key: int) -> int:
    """hpcps.data.hashing's string hash, in Python integers."""
    m = (1 << 64) - 1

    def splitmix(x):
        x = (x + 0x9E3779B97F4A7C15) & m
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
        return x ^ (x >> 31)
    h = 0
    for b in value:
        h = (h * 0x100000001B3 + b) & m
    return splitmix(h ^ splitmix(len(value) ^ key))


@pytest.mark.parametrize("text,sets,match", [
    ("a,b,c\n1,x,y\n0,x\n1,x,y\n", [], r"x\.csv:3: 2 fields, expected 3"),             # mixed column counts
    ("1,x,y\n0,x,y\n", ["data.header=true", "data.label=0"], r"x\.csv:1: data.header = true, but the first "
                                                             r"line looks like data"),
    ("1,x,y\n0,x,y\n", ["data.label=click"], r"'click' names a column, but .*x\.csv has no header line"),
    ("a,b,c\n1,x,y\n", ["data.label=click"], r"no column 'click' in the header of .*x\.csv \(columns: a, b, c\)"),
    ("a,b,c\n" + "1,x,y\n7,x,y\n" * 6, [], r"6 bad lines .*\n.*x\.csv:3: label \(column a\) must be 0 or 1.*\n.*x\.csv:5"
                                           r".*\n.*x\.csv:7.*\n  \.\.\. and 3 more"),
])
def test_bad_csv_input_names_the_file_and_line(tmp_path, text, sets, match):
    (tmp_path / "x.csv").write_text(text)
    base = ["data.format=csv", f"data.path={tmp_path / 'x.csv'}", "data.label=a", "data.batch_size=1",
            "job.epochs=1", "data.eval_fraction=0"]
    with pytest.raises(ValueError, match=match):
        make_data(load_config(None, base + sets, environ={}).data, 0, 1, 0)


def test_bad_lines_skipped_in_a_stream_leave_their_place_to_copies(tmp_path):
    rows = [f"{i % 2},{i},s{i}" for i in range(100)]
    rows[10] = "1,oops,s"
    rows[50] = ""
    (tmp_path / "x.csv").write_text("label,sid,site\n" + "\n".join(rows) + "\n")
    sets = ["data.skip_bad_lines=true", "data.batch_size=20", "data.shuffle_buffer=50"]
    d = _data(tmp_path / "x.csv", 1, 0, *sets)
    seen = sum((_sids(d.train_batch(s)) for s in range(5)), [])
    assert len(seen) == 100 and set(seen) == set(range(100)) - {10, 50}
    assert d.stats["skipped_lines"] == 1 and d.stats["empty_lines"] == 1 and d.stats["filled_places"] == 2
    with pytest.raises(BadLine, match=r"x\.csv:12: column sid is not a finite number: 'oops'"):
        _data(tmp_path / "x.csv", 1, 0, "data.batch_size=20").train_batch(0)


def test_header_that_differs_between_parts_is_an_error(tmp_path):
    (tmp_path / "a.csv").write_text("label,x\n1,a\n")
    (tmp_path / "b.csv").write_text("label,y\n1,a\n")
    with pytest.raises(ValueError, match=r"b\.csv:1: its header differs from .*a\.csv"):
        _data(tmp_path / "*.csv", 1, 0, "data.dense=")


_RSS = """
import resource, sys
from hpcps.config import load_config
from hpcps.data import make_data
cfg = load_config(None, ["data.format=criteo", "data.path=" + sys.argv[1], "data.batch_size=512", "job.epochs=1",
                         "data.reader=stream", "data.eval_fraction=0.01", "data.shuffle_buffer=2048"], environ={})
d = make_data(cfg.data, 0, 2, 1)
for s in range(d.steps_per_epoch):
    d.train_batch(s)
n = sum(len(b) for b in d.eval_batches())
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, n)
"""


def test_stream_memory_does_not_grow_with_the_input(tmp_path):
    peaks = []
    for rows in (20_000, 200_000):                       # ~6 MB and ~57 MB of Criteo-format text
        out = tmp_path / f"c{rows}"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_ctr_files.py"), "criteo", "--rows", str(rows),
                        "--parts", "2", "--gzip", "--out", str(out)], check=True, capture_output=True)
        r = subprocess.run([sys.executable, "-c", _RSS, str(out / "day_*")], check=True, capture_output=True,
                           text=True, timeout=300, cwd=ROOT)
        kb, n = map(int, r.stdout.split())
        assert n == rows // 100 // 2 or n == (rows // 100 + 1) // 2
        peaks.append(kb)
    assert peaks[1] < 1.1 * peaks[0], peaks              # 10x the input, within 10% of the memory
    # (windows of 2048 lines: both inputs fill them; bench_data.py measures the default at 600 MB)


def test_a_loader_process_streams_the_same_batches(tmp_path):
    from hpcps.data.loader import BatchAhead
    spec = _csv(tmp_path)
    data, ref = _data(spec, 3, 2), _data(spec, 3, 2)
    with BatchAhead(data, 4, 60, depth=2) as loader:            # across an epoch's end (25 steps)
        for step in range(4, 60):
            a, b = loader.train_batch(step), ref.train_batch(step)
            assert _sids(a) == _sids(b) and all(np.array_equal(x, y) for x, y in zip(a.sparse, b.sparse))


def test_stream_split_batches_gives_the_same_global_batches_whatever_the_workers(tmp_path):
    spec = _csv(tmp_path)
    one = _data(spec, 1, 0, "data.stream_split=batches")
    three = [_data(spec, 3, w, "data.stream_split=batches") for w in range(3)]
    for step in (0, 1, 7, 24, 25, 40):                          # epoch 1 as well
        assert sum((_sids(d.train_batch(step)) for d in three), []) == _sids(one.train_batch(step))
    assert sorted(sum((_sids(one.train_batch(s)) for s in range(25)), [])) == list(range(1000))
    state = three[0].state(10)                     # a restart in shares with other workers: still exact
    two = [_data(spec, 2, w) for w in range(2)]
    for d in two:
        d.resume(state, 10)
    seen = sum((_sids(one.train_batch(s)) for s in range(10)), [])
    seen += sum((_sids(d.train_batch(s)) for s in range(10, 25) for d in two), [])
    assert sorted(seen) == list(range(1000))
