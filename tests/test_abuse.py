"""A careless or hostile user at the command line: every bad input is one clear line naming the
key, file or value, exit 2, no traceback, nothing written. The multi-rank failures (errors on some
ranks, signals, stalls, bad checkpoints at resume) are in test_failures.py, test_checkpoint_store.py
and test_checkpoint_mpi.py; malformed data lines in test_data.py."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import h5py
import pytest

from mpirun import ROOT


def _files(d):
    (d / "str.toml").write_text('[job]\nsteps = "10"\n')
    (d / "strlist.toml").write_text('[model]\nbottom_mlp = "64"\n')
    (d / "syntax.toml").write_text("[job]\nsteps = \n")
    (d / "dup.toml").write_text("[job]\nsteps = 1\nsteps = 2\n")
    (d / "unknown.toml").write_text("[jobs]\nsteps = 1\n")
    (d / "afile").write_text("x")
    (d / "two.csv").write_text("y,a\n1,x\n0,z\n")
    (d / "foreign.h5").write_bytes(b"not hdf5")
    with h5py.File(d / "real.h5", "w") as f:                   # a valid HDF5 file that is no checkpoint
        f["x"] = [1.0, 2.0]
    (d / "ck").mkdir()
    (d / "latin1.toml").write_bytes(b'[job]\nsteps = 10  # r\xe9sum\xe9\n')
    (d / "latin1.jsonl").write_bytes(b'{"step": 1, "loss": 0.5}\n{"note": "\xe9t\xe9"}\n')


# (id, argv, extra environment, what the one line must contain)
CASES = [
    # config files
    ("toml-string-for-int", ["train", "--config", "{d}/str.toml"], {}, "job.steps = '10'"),
    ("toml-string-for-list", ["train", "--config", "{d}/strlist.toml"], {}, "model.bottom_mlp"),
    ("toml-syntax", ["train", "--config", "{d}/syntax.toml"], {}, "line 2"),
    ("toml-duplicate-key", ["train", "--config", "{d}/dup.toml"], {}, "dup.toml"),
    ("toml-unknown-section", ["train", "--config", "{d}/unknown.toml"], {}, "jobs"),
    ("config-missing", ["train", "--config", "{d}/nope.toml"], {}, "nope.toml"),
    ("config-not-utf8", ["train", "--config", "{d}/latin1.toml"], {}, "latin1.toml is not UTF-8 text"),
    # --set and the environment
    ("underscore-int", ["train", "--set", "job.steps=1_000"], {}, "job.steps"),
    ("float-for-int", ["train", "--set", "job.steps=10.5"], {}, "job.steps"),
    ("unknown-key", ["train", "--set", "job.stepz=1"], {}, "did you mean 'job.steps'"),
    ("negative-steps", ["train", "--set", "job.steps=-1"], {}, "job.steps"),
    ("negative-epochs", ["train", "--set", "job.epochs=-1"], {}, "job.epochs = '-1' (--set): must be >= 0"),
    # issue 51.10: synthetic data blamed job.steps; no held-out lines was a TypeError after the first epoch
    ("auto-epochs-synthetic", ["train", "--set", "job.epochs=auto"], {}, "job.epochs = 'auto': synthetic data is endless"),
    ("auto-epochs-nothing-held-out", ["train", "--set", "data.format=csv", "data.path={d}/two.csv", "data.label=y",
                                      "job.epochs=auto", "data.eval_fraction=0"], {}, "no held-out lines to evaluate"),
    ("mlp-of-text", ["train", "--set", "model.bottom_mlp=abc"], {}, "model.bottom_mlp = 'abc' (--set): expected a list of integers"),
    ("env-misspelled", ["train"], {"HPCPS_JOB_STEPZ": "3"}, "HPCPS_JOB_STEPZ names no config key; did you mean 'HPCPS_JOB_STEPS'"),
    ("zero-dim", ["train", "--set", "model.dim=0"], {}, "model.dim"),
    ("negative-batch", ["train", "--set", "data.batch_size=-4"], {}, "data.batch_size"),
    ("bad-mode", ["train", "--set", "job.mode=ssp:x"], {}, "job.mode"),
    ("bad-ps-layout", ["train", "--set", "job.ps_layout=first"], {}, "job.ps_layout"),
    ("bad-model-kind", ["train", "--set", "model.kind=xyz"], {}, "model.kind"),
    ("lr-over-float32", ["train", "--set", "optimizer.sparse.lr=1e39"], {}, "lr must be"),
    ("nan-lr", ["train", "--set", "optimizer.sparse.lr=nan"], {}, "lr"),
    ("every-steps-without-dir", ["train", "--set", "checkpoint.every_steps=5"], {}, "needs checkpoint.dir"),
    ("ckpt-dir-is-a-file", ["train", "--set", "checkpoint.dir={d}/afile"], {}, "is a file"),
    ("data-path-missing", ["train", "--set", "data.format=criteo", "data.path={d}/none.txt"], {}, "none.txt"),
    ("ratings-without-file", ["train", "--set", "data.format=ratings"], {}, "needs a file"),
    ("env-not-an-int", ["train"], {"HPCPS_NUM_PS": "abc"}, "HPCPS_NUM_PS"),
    ("world-of-one", ["train"], {}, "was the job started with mpiexec"),
    # checkpoint tools
    ("ckpt-ls-missing-dir", ["ckpt", "ls", "{d}/nodir"], {}, "no such file or directory"),
    ("ckpt-ls-a-file", ["ckpt", "ls", "{d}/afile"], {}, "not a directory"),
    ("ckpt-verify-missing", ["ckpt", "verify", "{d}/nodir"], {}, "no such file or directory"),
    ("ckpt-inspect-foreign-h5", ["ckpt", "inspect", "{d}/foreign.h5"], {}, "no verified checkpoint"),
    ("ckpt-inspect-plain-h5", ["ckpt", "inspect", "{d}/real.h5"], {}, "no verified checkpoint"),
    ("ckpt-export-empty-dir", ["ckpt", "export", "{d}/ck", "--out", "{d}/o.h5"], {}, "no verified checkpoint"),
    # other commands
    ("report-missing", ["report", "{d}/nothing"], {}, "no such file or directory"),
    ("report-not-utf8", ["report", "{d}/latin1.jsonl"], {}, "latin1.jsonl:2: not UTF-8 text"),
    ("demo-zero-rows", ["demo", "--rows", "0"], {}, "--rows must be >= 1"),
    ("demo-bad-zipf", ["demo", "--zipf", "0.5"], {}, "--zipf must be > 1"),
    ("bench-unknown", ["bench", "nosuch"], {}, "invalid choice: 'nosuch'"),
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every case run once, two at a time (each is a process of its own, about a second)."""
    d = tmp_path_factory.mktemp("abuse")
    _files(d)
    before = sorted(p.name for p in d.iterdir())

    def one(case):
        _, argv, env, _ = case
        e = dict(os.environ, HPCPS_MALLOC_TUNE="0", PYTHONPATH=str(ROOT), **env)
        for k in ("HPCPS_NUM_PS", "HPCPS_CKPT_DIR", "HPCPS_CLUSTER"):
            if k not in env:
                e.pop(k, None)
        return subprocess.run([sys.executable, "-m", "hpcps", *[a.format(d=d) for a in argv]], capture_output=True,
                              text=True, timeout=60, env=e, cwd=d, stdin=subprocess.DEVNULL)

    with ThreadPoolExecutor(2) as pool:
        results = dict(zip([c[0] for c in CASES], pool.map(one, CASES)))
    return results, before, sorted(p.name for p in d.iterdir())


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line(outcomes, case):
    name, _, _, want = case
    r = outcomes[0][name]
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and want in errors[0], r.stderr


def test_bad_input_writes_nothing(outcomes):
    _, before, after = outcomes
    assert after == before
