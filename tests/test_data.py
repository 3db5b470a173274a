from pathlib import Path

import numpy as np
import pytest

from hpcps.config import load_config
from hpcps.data import BadLine, SyntheticCTR, criteo_layout, make_data, parse_block, parse_rating
from hpcps.core.metrics import auc

ROOT = Path(__file__).resolve().parent.parent
CRITEO = ROOT / "tests" / "data" / "criteo_head1000.txt"


def _synth(workers, worker, **kw):
    args = dict(num_tables=3, rows_per_table=1000, num_dense=4, batch_size=64, eval_samples=300, zipf=1.2,
                seed=1, num_workers=workers, worker=worker)
    args.update(kw)
    return SyntheticCTR(**args)


@pytest.mark.parametrize("batch", [64, 1000])       # one block; slices across block boundaries
def test_synthetic_worker_slices_make_the_global_batch(batch):
    whole = _synth(1, 0, batch_size=batch).train_batch(5)
    assert len(whole) == batch
    parts = [_synth(3, w, batch_size=batch).train_batch(5) for w in range(3)]
    np.testing.assert_array_equal(np.concatenate([p.labels for p in parts]), whole.labels)
    for t in range(3):
        np.testing.assert_array_equal(np.concatenate([p.sparse[t] for p in parts]), whole.sparse[t])
    np.testing.assert_array_equal(np.concatenate([p.dense for p in parts]), whole.dense)
    assert not np.array_equal(_synth(1, 0, batch_size=batch).train_batch(6).labels, whole.labels)
    per_worker = [list(_synth(3, w, batch_size=batch).eval_batches()) for w in range(3)]
    whole_eval = list(_synth(1, 0, batch_size=batch).eval_batches())
    assert len(whole_eval) == -(-300 // batch)            # 300 samples: the last batch is short
    for k, batch in enumerate(whole_eval):
        np.testing.assert_array_equal(np.concatenate([w[k].truth for w in per_worker]), batch.truth)


def test_synthetic_is_zipf_and_planted_auc_is_high():
    d = _synth(1, 0, batch_size=4096, eval_samples=20000)
    b = d.train_batch(0)
    ids = b.sparse[0]
    assert ids.min() >= 0 and ids.max() < 1000
    assert (ids == 0).mean() > 0.15 > (ids == 10).mean() * 10   # Zipf: the head row is hot
    y = np.concatenate([x.labels for x in d.eval_batches()])
    p = np.concatenate([x.truth for x in d.eval_batches()])
    assert 0.7 < auc(y, p) < 1.0
    assert 0.1 < y.mean() < 0.6


def _criteo_line(line):
    block = (line + "\n").encode()
    return parse_block(block, 1, lambda i: f"f:{i + 1}", criteo_layout(1 << 20), False, {})


def test_criteo_line_parsing_pads_and_validates():
    dense, keys, labels, _ = _criteo_line("1\t5\t\t-3" + "\t" * 10 + "\t68fd1e64\t")
    assert labels[0] == 1 and dense.shape == (1, 13) and keys.shape == (1, 26)
    np.testing.assert_allclose(dense[0, :3], np.log1p([5, 0, 0]), rtol=1e-6)    # log(1 + max(x, 0))
    from hpcps.core.ids import splitmix64
    from hpcps.data.hashing import column_key
    assert keys[0, 0] == int(splitmix64(np.uint64(0x68FD1E64) ^ column_key(0)) % np.uint64(1 << 20))
    for bad, msg in [("1\t2\t3", "3 fields, expected 40"),       # cut short: fewer than the label, I1-I13 and C1
                     ("2" + "\t1" * 14, "label .* must be 0 or 1"), ("0\tx" + "\t1" * 13, "I1 is not a finite number"),
                     ("0" + "\t1" * 13 + "\tzz", "C1 is not a hex value"), ("0" + "\t" * 45, "expected 40"),
                     ("0" + "\t1" * 13 + "\t" + "f" * 32, "at most 64 bits"),
                     ("0" + "\t1" * 13 + "\t-ff", "C1 is not a hex value"), ("0" + "\t1" * 13 + "\tf_f", "hex")]:
        with pytest.raises(ValueError, match=msg):
            _criteo_line(bad)


def test_criteo_real_sample_reads_and_shards():
    cfg = load_config(None, ["data.format=criteo", f"data.path={CRITEO}", "data.batch_size=100",
                             "data.hash_rows=5000", "job.epochs=1"], environ={})
    whole = make_data(cfg.data, 0, 1, 0)
    assert whole.stats["train_samples"] == 900 and whole.stats["eval_samples"] == 100
    assert len(whole.tables) == 26 and whole.num_dense == 13
    b = whole.train_batch(0)
    assert all(s.min() >= 0 and s.max() < 5000 for s in b.sparse)
    assert b.dense.min() >= 0 and np.isin(b.labels, [0, 1]).all()
    parts = [make_data(cfg.data, 0, 2, w).train_batch(0) for w in range(2)]
    np.testing.assert_array_equal(np.concatenate([p.labels for p in parts]), b.labels)


def test_criteo_malformed_line_names_file_and_line(tmp_path):
    good = "0" + "\t1" * 13 + "\tab" * 26
    f = tmp_path / "c.txt"
    f.write_text("\n".join([good] * 5 + ["0\tnot-a-number" + "\t1" * 13] + [good] * 4) + "\n")
    sets = ["data.format=criteo", f"data.path={f}", "data.batch_size=2", "job.epochs=1"]
    with pytest.raises(BadLine, match=rf"{f}:6: column I1 is not a finite number"):
        make_data(load_config(None, sets, environ={}).data, 0, 1, 0)
    d = make_data(load_config(None, sets + ["data.skip_bad_lines=true"], environ={}).data, 0, 1, 0)
    assert d.stats["skipped_lines"] == 1 and d.stats["train_samples"] + d.stats["eval_samples"] == 9


@pytest.mark.parametrize("line,expected", [
    ("12::7::4::978300760", ("12", "7", 4.0)),
    ("12\t7\t3.5", ("12", "7", 3.5)),
    ("u1,i9,2,5", ("u1", "i9", 2.0)),
    ("3 4 1", ("3", "4", 1.0)),
])
def test_rating_separators(line, expected):
    assert parse_rating(line) == expected


def test_ratings_remap_header_unknown_and_errors(tmp_path):
    train = tmp_path / "train.csv"
    train.write_text("userId,movieId,rating,timestamp\n10,100,4,1\n20,100,3,2\n10,300,5,3\n20,300,1,4\n")
    ev = tmp_path / "eval.csv"
    ev.write_text("10,100,4,1\n99,300,2,2\n")
    cfg = load_config(None, ["data.format=ratings", "model.kind=mf", f"data.path={train}",
                             f"data.eval_path={ev}", "data.batch_size=2", "job.epochs=1"], environ={})
    d = make_data(cfg.data, 0, 1, 0)
    assert d.tables == [("users", 3), ("items", 3)]          # 2 known + 1 unknown row each
    assert d.stats["eval_unknown_ids"] == 1 and d.mean_rating == pytest.approx(3.25)
    b = next(d.eval_batches())
    np.testing.assert_array_equal(b.sparse[0], [0, 2])       # user 99 -> the unknown row
    bad = tmp_path / "bad.dat"
    bad.write_text("1::2::5\n1::2\n")
    cfg2 = load_config(None, ["data.format=ratings", "model.kind=mf", f"data.path={bad}", "job.epochs=1"],
                       environ={})
    with pytest.raises(BadLine, match=rf"{bad}:2: expected 'user item rating"):
        make_data(cfg2.data, 0, 1, 0)


def test_file_epoch_order_is_deterministic_per_seed(tmp_path):
    f = tmp_path / "r.dat"
    f.write_text("".join(f"{u}::{u % 7}::{u % 5 + 1}\n" for u in range(100)))
    sets = ["data.format=ratings", "model.kind=mf", f"data.path={f}", "data.batch_size=10", "job.epochs=2",
            "data.eval_fraction=0"]
    a = make_data(load_config(None, sets, environ={}).data, 3, 1, 0)
    b = make_data(load_config(None, sets, environ={}).data, 3, 1, 0)
    c = make_data(load_config(None, sets, environ={}).data, 4, 1, 0)
    seq = lambda d: np.concatenate([d.train_batch(s).sparse[0] for s in range(20)])  # noqa: E731
    np.testing.assert_array_equal(seq(a), seq(b))
    assert not np.array_equal(seq(a), seq(c))
    first_epoch = np.sort(np.concatenate([a.train_batch(s).sparse[0] for s in range(10)]))
    np.testing.assert_array_equal(first_epoch, np.arange(100))    # each sample once per epoch


@pytest.mark.parametrize("workers", [1, 3])
def test_no_sample_is_dropped_from_an_epoch_and_batches_stay_full(tmp_path, workers):
    """103 samples in batches of 10: 11 steps an epoch, every one full; epoch 0's samples all come
    in its 11 steps (the last batch completed by epoch 1's first 7), and epoch 1's by step 21."""
    f = tmp_path / "r.dat"
    f.write_text("".join(f"{u}::{u % 7}::{u % 5 + 1}\n" for u in range(103)))
    sets = ["data.format=ratings", "model.kind=mf", f"data.path={f}", "data.batch_size=10", "job.epochs=2",
            "data.eval_fraction=0"]
    parts = [make_data(load_config(None, sets, environ={}).data, 3, workers, w) for w in range(workers)]
    assert parts[0].steps_per_epoch == 11 and parts[0].stats["train_samples"] == 103
    steps = [np.concatenate([d.train_batch(s).sparse[0] for d in parts]) for s in range(22)]
    assert all(x.size == 10 for x in steps)
    stream = np.concatenate(steps)
    np.testing.assert_array_equal(np.sort(stream[:103]), np.arange(103))          # epoch 0, each once
    np.testing.assert_array_equal(np.sort(stream[103:206]), np.arange(103))       # then epoch 1
    assert not np.array_equal(stream[:103], stream[103:206])                      # in another order


def test_wrapped_zipf_cdf_is_the_distribution_of_numpy_zipf_mod_rows():
    from hpcps.data.synthetic import wrapped_zipf_cdf
    for a, rows in ((1.2, 50), (2.0, 7)):
        cdf = wrapped_zipf_cdf(a, rows)
        assert cdf.shape == (rows,) and cdf[-1] == 1.0 and np.all(np.diff(cdf) > 0)
        x = (np.random.default_rng(0).zipf(a, 2_000_000) - 1) % rows
        empirical = np.bincount(x, minlength=rows) / x.size
        np.testing.assert_allclose(np.diff(cdf, prepend=0.0), empirical, atol=1.5e-3)


@pytest.mark.parametrize("a, rows", [(1.2, 10000), (1.05, 100), (3.0, 7), (2.0, 1), (1.5, 300_000)])
def test_guide_table_draws_the_ids_a_binary_search_would(a, rows):
    """SyntheticCTR._inverse_cdf is searchsorted(cdf, u, "right") bit for bit: random draws, the
    CDF's own values and the doubles just below them (where a bucket's first candidate is wrong)."""
    d = SyntheticCTR(2, rows, 1, 8, 8, a, 0, 1, 0)
    cdf = d._cdfs[rows][0]
    u = np.random.default_rng(rows).random((3, 50_000))
    u[0, :3] = [0.0, np.nextafter(1.0, 0.0), 0.5]
    edges = cdf[cdf < 1][:50_000]
    u[1, :edges.size], u[2, :edges.size] = edges, np.nextafter(edges, 0.0)
    got = d._inverse_cdf(u, rows)
    assert got.shape == u.shape
    np.testing.assert_array_equal(got, np.searchsorted(cdf, u, side="right"))


def test_synthetic_tables_of_their_own_sizes_scaled_each_draw_from_its_own_zipf(monkeypatch):
    """data.table_rows and data.scale (examples/large.toml): each table has its rows (rounded up,
    at least 1) and its own wrapped Zipf distribution, CDF or numpy's sampler per size; the worker
    slices still make the global batch."""
    import hpcps.data.synthetic as syn
    cfg = load_config(None, ["data.table_rows=[40000, 3, 500, 9000000]", "data.scale=0.5"], environ={}).data
    assert syn.synthetic_rows(cfg) == [20000, 2, 250, 4500000]
    assert syn.synthetic_rows(load_config(None, ["data.num_tables=2", "data.rows_per_table=7"], environ={}).data) == [7, 7]
    monkeypatch.setattr(syn, "CDF_ROWS", 100_000)          # the 4.5M-row table: numpy's Zipf sampler
    rows = syn.synthetic_rows(cfg)
    whole = SyntheticCTR(0, 0, 2, 4096, 64, 1.2, 3, 1, 0, table_rows=rows).train_batch(1)
    assert [int(s.max()) < r for s, r in zip(whole.sparse, rows)] == [True] * 4
    for t in (0, 2):                                        # each table's ids follow its own distribution
        cdf = syn.wrapped_zipf_cdf(1.2, rows[t])
        assert abs(np.mean(whole.sparse[t] == 0) - cdf[0]) < 0.03
    assert set(np.unique(whole.sparse[1])) == {0, 1}
    parts = [SyntheticCTR(0, 0, 2, 4096, 64, 1.2, 3, 3, w, table_rows=rows).train_batch(1) for w in range(3)]
    for t in range(4):
        np.testing.assert_array_equal(np.concatenate([p.sparse[t] for p in parts]), whole.sparse[t])
    with pytest.raises(ValueError, match="data.table_rows"):
        load_config(None, ["data.table_rows=[10, 0]"], environ={})


def test_synthetic_without_tables_of_cdf_or_weights_still_slices_alike(monkeypatch):
    import hpcps.data.synthetic as syn
    monkeypatch.setattr(syn, "CDF_ROWS", 10)              # tables "too large": numpy's Zipf sampler
    monkeypatch.setattr(syn, "PLANTED_ENTRIES", 0)        # planted weights computed per batch
    whole = _synth(1, 0, batch_size=300).train_batch(2)
    assert whole.sparse[0].min() >= 0 and whole.sparse[0].max() < 1000
    parts = [_synth(3, w, batch_size=300).train_batch(2) for w in range(3)]
    for t in range(3):
        np.testing.assert_array_equal(np.concatenate([p.sparse[t] for p in parts]), whole.sparse[t])
    np.testing.assert_array_equal(np.concatenate([p.truth for p in parts]), whole.truth)
    monkeypatch.undo()
    fast = _synth(1, 0, batch_size=300).train_batch(2)     # the table path: same planted weights
    ref = syn.initial_rows(1, "planted/0", fast.sparse[0], 1, scale=1.0)[:, 0]
    np.testing.assert_array_equal(_synth(1, 0, batch_size=300)._planted[0][fast.sparse[0]], ref)


def test_criteo_values_over_64_bits_name_file_and_line_or_are_skipped(tmp_path):
    good = "1" + "\t1" * 13 + "\t68fd1e64" * 26
    f = tmp_path / "c.txt"
    f.write_text("\n".join([good] * 5 + ["0" + "\t1" * 13 + "\t" + "f" * 32] + [good] * 4) + "\n")
    sets = ["data.format=criteo", f"data.path={f}", "data.batch_size=2", "job.steps=1"]
    with pytest.raises(BadLine, match=rf"{f.name}:6: column C1 is not a hex value of at most 64 bits"):
        make_data(load_config(None, sets, environ={}).data, 0, 1, 0)
    d = make_data(load_config(None, sets + ["data.skip_bad_lines=true"], environ={}).data, 0, 1, 0)
    assert d.stats["skipped_lines"] == 1


@pytest.mark.parametrize("rating", ["1e39", "inf", "nan", "-2e7"])
def test_ratings_out_of_float32_range_name_the_line(rating):
    with pytest.raises(ValueError, match="is not a finite number of at most 1e6"):
        parse_rating(f"1::2::{rating}::0")


def _criteo_data(spec, *extra):
    cfg = load_config(None, ["data.format=criteo", f"data.path={spec}", "data.batch_size=100", "data.hash_rows=5000",
                             "job.epochs=1", "data.eval_fraction=0", *extra], environ={})
    return make_data(cfg.data, 0, 1, 0)


def test_a_glob_or_list_of_plain_gzip_and_bzip2_parts_reads_as_the_whole_file(tmp_path):
    import bz2
    import gzip
    lines = CRITEO.read_text().splitlines(keepends=True)
    (tmp_path / "day-0.txt").write_text("".join(lines[:300]))
    with gzip.open(tmp_path / "day-1.gz", "wt") as f:
        f.write("".join(lines[300:700]))
    with bz2.open(tmp_path / "day-2.bz2", "wt") as f:
        f.write("".join(lines[700:]))
    whole = _criteo_data(CRITEO)
    for spec in (f"{tmp_path}/day-*", f"{tmp_path}/day-0.txt, {tmp_path}/day-1.gz,{tmp_path}/day-2.bz2", tmp_path):
        parts = _criteo_data(spec)
        assert parts.stats["train_samples"] == whole.stats["train_samples"] == 1000
        for step in (0, 9):
            a, b = whole.train_batch(step), parts.train_batch(step)
            np.testing.assert_array_equal(a.labels, b.labels)
            assert all(np.array_equal(x, y) for x, y in zip(a.sparse, b.sparse))


def test_bad_input_specs_and_a_truncated_gzip_name_the_file(tmp_path):
    import gzip
    with pytest.raises(ValueError, match=r"the glob '.*/nothing-\*.gz' matches no file"):
        _criteo_data(f"{tmp_path}/nothing-*.gz")
    with pytest.raises(ValueError, match=r"data.path = .*: .*/missing.txt: no such file"):
        _criteo_data(f"{CRITEO},{tmp_path}/missing.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="the directory .*empty holds no file"):
        _criteo_data(f"{CRITEO},{tmp_path / 'empty'}")
    with pytest.raises(ValueError, match="data.eval_path = '/nope.gz': no such file"):
        _criteo_data(CRITEO, "data.eval_path=/nope.gz")
    blob = gzip.compress(CRITEO.read_bytes())
    cut = tmp_path / "cut.gz"
    cut.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ValueError, match=rf"{cut}: cannot be read past line \d+ .*truncated or damaged"):
        _criteo_data(cut)
