"""Training under a real mpiexec: sync equals single-process PyTorch, async converges, SSP bounds staleness."""

import json
import os
import sys

import numpy as np
import pytest

from hpcps.config import load_config
from hpcps.tools.reference import train_reference
from hpcps.core.ids import initial_rows
from hpcps.data import make_data
from hpcps.train import table_specs
from mpirun import ROOT, run_mpi, run_selected, selected, train_many

TINY = ROOT / "tests" / "configs" / "tiny_ctr.toml"
CRITEO = ROOT / "tests" / "data" / "criteo_head1000.txt"


def _final(stdout):
    lines = [json.loads(l) for l in stdout.splitlines() if l.startswith('{"final"')]
    assert len(lines) == 1, stdout
    return lines[0]["final"]


def _train(n, sets, config=TINY, timeout=240, **kw):
    return run_mpi(n, ["-m", "hpcps", "train", "--config", config, "--set", *sets], timeout=timeout, **kw)


def _assert_matches_reference(out, sets, config=TINY):
    """The export ``out`` of a run of ``config`` with ``sets`` equals single-process PyTorch's."""
    got = np.load(out)
    cfg = load_config(config, sets, environ={})
    ref = train_reference(cfg)
    assert set(got.files) == set(ref)
    for k, want in ref.items():
        np.testing.assert_allclose(got[k], want, rtol=1e-4, atol=5e-5, err_msg=k)
    # the comparison means something: tables moved far more than the tolerance
    start = {name: initial_rows(cfg.job.seed, name, np.arange(rows), dim, scale, kind=kind)
             for name, rows, dim, kind, scale in table_specs(cfg, make_data(cfg.data, cfg.job.seed, 1, 0))}
    moved = max(float(np.abs(ref[k] - start[k.split("/")[1]]).max()) for k in ref if k.startswith("tables/"))
    assert moved > 2e-3, moved                                  # 40x the tolerance


OPTIMIZERS = [
    ["optimizer.sparse.name=sgd", "optimizer.sparse.lr=0.2"],
    ["optimizer.sparse.name=momentum", "optimizer.sparse.lr=0.2"],
    # eps 1e-3, not 1e-10: with an empty accumulator a row's first step is lr * g / (|g| + eps), so
    # a gradient that nearly cancels (the workers' sums add in another order than one process's)
    # would turn rounding noise into an lr-sized difference
    ["optimizer.sparse.name=adagrad", "optimizer.sparse.eps=1e-3"],
    ["optimizer.sparse.name=rowwise_adagrad", "optimizer.sparse.lr=0.2"],
    ["optimizer.sparse.name=adam", "optimizer.sparse.lr=0.05"],
    # FTRL-proximal, l1 = 0: an L1 threshold would turn the order of the workers' sums into jumps
    ["optimizer.sparse.name=ftrl", "optimizer.sparse.lr=0.1", "optimizer.sparse.l2=0.01"],
]


LAYOUTS = {"1ps-2w": (3, 1, "auto", "off"), "1ps-3w-pipelined": (4, 1, "auto", "on"),
           "2ps-3w-rma-pipelined": (5, 2, "rma", "auto")}


# every optimizer on one PS with the pipeline; 2 PS over RMA with it for the accumulator kinds; the
# plain layout (no pipeline, shared memory) for a stateless and a stateful one (every optimizer but
# FTRL runs without the pipeline over RMA to a PS on another host in tests/test_hosts.py)
SOME = {"1ps-2w": ("sgd", "adam"), "2ps-3w-rma-pipelined": ("adagrad", "adam", "ftrl")}


CASES = [(o, lay) for lay in LAYOUTS for o in OPTIMIZERS if lay not in SOME or o[0].split("=")[1] in SOME[lay]]


def _case_sets(opt, layout):
    n, ps, transport, pipeline = LAYOUTS[layout]
    # the pipeline (prefetch + communication thread, which needs MPI_THREAD_MULTIPLE); "auto" turns
    # it on for rma
    return opt + [f"job.num_ps={ps}", f"job.transport={transport}", f"pipeline.prefetch={pipeline}",
                  f"pipeline.background_push={pipeline}"]


# the other sync-equivalence cases: (ranks, sets)
OTHER = {
    # with the per-occurrence embedding L2 in the loss, and normal initial rows
    "table-per-feature": (3, OPTIMIZERS[2] + ["model.fuse_tables=false", "model.embedding_l2=0.01",
                                              "model.init=normal", "model.init_scale=0.05"]),
    "decay-schedule-clipping": (4, [
        "optimizer.sparse.name=sgd", "optimizer.sparse.lr=0.5", "optimizer.sparse.weight_decay=0.05",
        "optimizer.sparse.schedule=cosine", "optimizer.sparse.warmup_steps=5", "optimizer.sparse.clip_norm=0.05",
        "optimizer.dense.name=momentum", "optimizer.dense.schedule=step", "optimizer.dense.step_size=10",
        "model.embedding_l2=0.02"]),
    "matrix-factorisation": (4, [
        "data.format=ratings", "model.kind=mf", "data.batch_size=60", "job.epochs=2", "optimizer.sparse.name=adam",
        "optimizer.sparse.lr=0.05", "optimizer.dense.name=sgd", "model.embedding_l2=0.02"]),
}
# every model kind of hpcps.models but DLRM (above) and MF: its tables fused (one per part) on one
# PS, and a table per feature over 2 PS; the wide part's own optimizer (FTRL) in one of each
KINDS = ("lr", "wide_deep", "deepfm", "dcn")
for _k in KINDS:
    OTHER[f"{_k}-fused-1ps"] = (3, [f"model.kind={_k}", "model.embedding_l2=0.01"]
                                + (["optimizer.wide.name=ftrl", "optimizer.wide.lr=0.1", "optimizer.wide.l2=0.01"]
                                   if _k != "dcn" else []))
    OTHER[f"{_k}-per-feature-2ps"] = (5, [f"model.kind={_k}", "model.fuse_tables=false", "job.num_ps=2"])
# DLRM-DCNv2 (examples/large.toml's model: low-rank cross layers instead of the dots) on synthetic
# tables of their own sizes, scaled (data.table_rows, data.scale: 150, 4 and 500 rows)
OTHER["dlrm-dcn-table-rows"] = (3, ["model.interaction=dcn", "model.cross_layers=2", "model.cross_rank=3",
                                    "data.table_rows=[300, 7, 1000]", "data.scale=0.5"])
# runs whose bits must not change with a switch: (ranks, {variant: sets})
SWITCHES = {
    # model.fuse_tables (the default) keeps the feature tables in one table-batched hpcps table;
    # with one worker every sum has one order, so the weights match one table per feature bit for
    # bit, exported under the feature tables' names either way
    "fuse": (2, {"true": ["model.fuse_tables=true"], "false": ["model.fuse_tables=false"]}),
    # pipeline.loader: each worker's batches drawn ahead by a child process (auto turns it on for
    # 1 PS + 1 worker on 2 CPUs, off for 2 workers); the same batches, so the same weights
    "loader-2": (2, {"on": ["pipeline.loader=on"], "off": ["pipeline.loader=off"]}),
    "loader-3": (3, {"on": ["pipeline.loader=on"], "off": ["pipeline.loader=off"]}),
}


def _wanted(params: dict) -> set:
    """The cases of ``runs`` that a test with these parameters reads."""
    if "opt" in params:
        return {f"{params['layout']}-{params['opt'][0].split('=')[1]}"}
    if "case" in params:
        return {params["case"]}
    return {f"{params['switch']}-{v}" for v in SWITCHES[params["switch"]][1]}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The runs of the selected equivalence tests above, grouped into one launch per (ranks, thread
    level) (tests/programs/train_many.py: torch and MPI start once for the group). ``(dir, finals)``:
    the export of case ``c`` is ``dir / f"{c}.npz"``, its final summary ``finals[c]``."""
    wanted = set().union(*map(_wanted, selected(request)))
    d = tmp_path_factory.mktemp("runs")
    ratings = d / "r.dat"
    rng = np.random.default_rng(0)
    ratings.write_text("".join(f"{rng.integers(40)}::{rng.zipf(1.5) % 30}::{rng.integers(1, 6)}\n" for _ in range(1500)))
    groups = {}                                     # (ranks, threads) -> {case: sets}
    for opt, layout in CASES:
        n, _, _, pipeline = LAYOUTS[layout]
        groups.setdefault((n, pipeline != "off"), {})[f"{layout}-{opt[0].split('=')[1]}"] = _case_sets(opt, layout)
    for case, (n, sets) in OTHER.items():
        groups.setdefault((n, False), {})[case] = sets + ([f"data.path={ratings}"] if case == "matrix-factorisation" else [])
    for name, (n, variants) in SWITCHES.items():
        for v, sets in variants.items():
            groups.setdefault((n, False), {})[f"{name}-{v}"] = sets
    finals = {}
    for (n, multiple), cases in groups.items():
        cases = {c: sets for c, sets in cases.items() if c in wanted}
        if not cases:
            continue
        got = train_many(n, {c: ["--config", TINY, "--set", *sets, f"job.export={d / c}.npz"] for c, sets in cases.items()},
                         env={"HPCPS_MPI_THREADS": "multiple"} if multiple else None, timeout=600)
        finals.update({c: got[c][0] for c in cases})
    return d, finals, ratings


# the Open MPI leg (-m openmpi) runs these: the three layouts (shared memory; the communication
# thread at MPI_THREAD_MULTIPLE; 2 PS over RMA), a model kind with its wide part, and the loader's
# child process; every optimizer and model kind moves no other MPI call than these
OPENMPI = {"1ps-2w-sgd", "1ps-3w-pipelined-adam", "2ps-3w-rma-pipelined-ftrl", "wide_deep-fused-1ps", "loader-3"}


def _on_openmpi(*values, key):
    return pytest.param(*values, marks=[pytest.mark.openmpi] if key in OPENMPI else [])


@pytest.mark.parametrize("opt,layout", [_on_openmpi(o, lay, key=f"{lay}-{o[0].split('=')[1]}") for o, lay in CASES],
                         ids=lambda x: x if isinstance(x, str) else x[0].split("=")[1])
def test_sync_equals_single_process_torch(runs, opt, layout):
    _assert_matches_reference(runs[0] / f"{layout}-{opt[0].split('=')[1]}.npz", _case_sets(opt, layout))


@pytest.mark.parametrize("case", [_on_openmpi(c, key=c) for c in OTHER], ids=list(OTHER))
def test_sync_equals_single_process_torch_also(runs, case):
    """A table per feature (embedding L2, normal initial rows); decay, schedules and clipping;
    matrix factorisation on a ratings file; every other model kind (KINDS), fused and not, on 1
    and 2 PS."""
    d, _, ratings = runs
    sets = OTHER[case][1] + ([f"data.path={ratings}"] if case == "matrix-factorisation" else [])
    _assert_matches_reference(d / f"{case}.npz", sets)


@pytest.mark.parametrize("switch", [_on_openmpi(c, key=c) for c in SWITCHES], ids=list(SWITCHES))
def test_switches_that_change_no_bit(runs, switch):
    d, finals, _ = runs
    a, b = list(SWITCHES[switch][1])
    if switch.startswith("loader"):
        assert finals[f"{switch}-on"]["pipeline"]["loader"] is True
        assert finals[f"{switch}-off"]["pipeline"]["loader"] is False
    got = [np.load(d / f"{switch}-{v}.npz") for v in (a, b)]
    assert set(got[0].files) == set(got[1].files) >= {"tables/cat0", "tables/cat1", "tables/cat2", "dense/top.0.weight"}
    for k in got[0].files:
        np.testing.assert_array_equal(got[0][k], got[1][k], err_msg=k)


def test_async_converges_like_sync():
    sets = ["job.steps=600", "data.num_tables=4", "data.rows_per_table=2000", "data.batch_size=512",
            "data.eval_samples=20000", "metrics.progress=false"]
    runs = {"sync": ["job.mode=sync", "pipeline.prefetch=on"], "async": ["job.mode=async"],
            "cached": ["job.mode=async", "pipeline.cache_rows=4096", "pipeline.cache_staleness=3"],
            "bf16": ["job.mode=sync", "pipeline.pull_dtype=bfloat16", "pipeline.push_dtype=bfloat16",
                     "job.transport=rma"]}
    got = train_many(4, {name: ["--set", *extra, *sets] for name, extra in runs.items()}, timeout=400)
    res = {name: got[name][0] for name in runs}
    assert res["sync"]["auc"] > res["sync"]["planted_auc"] - 0.03        # it learned
    assert abs(res["async"]["auc"] - res["sync"]["auc"]) < 0.01
    assert res["async"]["mode"] == "async" and res["sync"]["max_staleness"] == 0
    # a hot-row cache with rows up to 3 steps old: hot rows hit (Zipf), training still converges
    pipe = res["cached"]["pipeline"]
    assert 0.1 < pipe["cache_hit_rate"] < 1 and pipe["cache_staleness"] == 3, pipe
    assert abs(res["cached"]["auc"] - res["sync"]["auc"]) < 0.015, (res["cached"]["auc"], res["sync"]["auc"])
    # sync prefetches and pulls again what other workers changed meanwhile; the pipeline is off by
    # default
    assert res["sync"]["pipeline"]["prefetch"] and 0 < res["sync"]["pipeline"]["prefetch_refreshed"] < 1
    assert not res["async"]["pipeline"]["prefetch"] and not res["async"]["pipeline"]["background_push"]
    # rows pulled and gradients pushed as bfloat16, over RMA (all through the PS's push mailboxes):
    # same learning, to AUC noise
    pipe = res["bf16"]["pipeline"]
    assert (pipe["pull_dtype"], pipe["push_dtype"], pipe["push_mailbox_full"]) == ("bfloat16", "bfloat16", 0), pipe
    assert abs(res["bf16"]["auc"] - res["sync"]["auc"]) < 0.01, (res["bf16"]["auc"], res["sync"]["auc"])


# bounded staleness: 1 PS + 3 workers, one of them slow, in one launch (mpirun.run_selected)
SSP = {"test_ssp_bound_holds_with_a_slow_worker": lambda p, d: [(4, False, ["ssp_bound.py", f"ssp:{p['bound']}", 40])],
       "test_async_has_no_bound": lambda p, d: [(4, False, ["ssp_bound.py", "async", 40])]}


@pytest.fixture(scope="module")
def ssp(request, tmp_path_factory):
    return run_selected(request, SSP, tmp_path_factory.mktemp("ssp"), timeout=300)


def _report(out: str) -> dict:
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")][-1]


@pytest.mark.parametrize("bound", [1, 3])
def test_ssp_bound_holds_with_a_slow_worker(ssp, request, bound):
    rep = _report(ssp[request.node.name][0][0])
    assert max(rep["max_staleness"]) == bound                 # reached, never exceeded
    assert rep["wait_seconds"][0] > 0.1                       # the fast worker was held back


def test_async_has_no_bound(ssp, request):
    rep = _report(ssp[request.node.name][0][0])
    assert max(rep["max_staleness"]) > 3                      # the same run without SSP drifts


def test_mpi_thread_level_serialized_unless_the_pipeline_thread_is_asked_for():
    r = _train(3, ["job.steps=6", "pipeline.background_push=on", "job.transport=rma"])
    final = _final(r.stdout)
    assert final["mpi_threads"] == "serialized" and not final["pipeline"]["background_push"]
    assert "HPCPS_MPI_THREADS=multiple" in r.stderr                  # on asked, inline given: said so
    r = _train(3, ["job.steps=6", "pipeline.background_push=auto", "job.transport=rma"])
    assert not _final(r.stdout)["pipeline"]["background_push"] and "HPCPS_MPI_THREADS" not in r.stderr
    r = _train(3, ["job.steps=6", "pipeline.background_push=auto", "job.transport=rma"],
               env={"HPCPS_MPI_THREADS": "multiple"})
    final = _final(r.stdout)
    assert final["mpi_threads"] == "multiple" and final["pipeline"]["background_push"]


@pytest.mark.impi
def test_train_end_to_end_metrics_and_final_line(tmp_path):
    metrics = tmp_path / "m.jsonl"
    r = _train(4, ["job.steps=40", "job.log_every=10", "job.eval_every=20", f"metrics.path={metrics}",
                   "job.mode=ssp:2"])
    final = _final(r.stdout)
    for key in ("auc", "logloss", "planted_auc", "samples_per_s", "steps", "max_staleness"):
        assert key in final
    assert final["steps"] == 40 and final["num_workers"] == 3 and final["max_staleness"] <= 2
    recs = [json.loads(l) for l in metrics.read_text().splitlines()]
    steps = [x for x in recs if "step" in x]
    assert [x["step"] for x in steps] == [10, 20, 30, 40]
    # issue 51.17: each record names its run; the first says when and how it started
    assert recs[0]["start"]["run"] == final["run"] and "train" in recs[0]["start"]["command"]
    assert {x["run"] for x in recs[1:]} == {final["run"]}
    for k in ("loss", "samples_per_s", "pull_ms", "push_ms", "staleness", "rows_per_ps", "time_breakdown_s"):
        assert k in steps[0], k
    assert set(steps[0]["time_breakdown_s"]) == {"data", "idle", "pull", "forward_backward", "push",
                                                 "dense_allreduce"}
    assert all(v >= 0 for v in steps[0]["time_breakdown_s"].values())
    assert steps[0]["time_breakdown_s"]["pull"] > 0 and steps[0]["time_breakdown_s"]["push"] > 0
    assert sum(steps[0]["staleness_counts"].values()) == 10                  # one per step of the record
    assert max(int(k) for x in steps for k in x["staleness_counts"]) <= 2     # ssp:2
    mem = final["memory"]
    assert len(mem["ps_peak_rss_mb"]) == 1 and len(mem["worker_peak_rss_mb"]) == 3
    assert mem["ps_peak_rss_mb"][0] > mem["ps_table_mb"][0] > 0
    assert recs[-1]["final"]["memory"] == mem
    rep = __import__("subprocess").run([sys.executable, "-m", "hpcps", "report", str(metrics), "--out",
                                        str(tmp_path / "report")], capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    assert {p.name for p in (tmp_path / "report").iterdir()} >= {"loss.png", "time_breakdown.png", "summary.md"}
    assert "- auc: " in (tmp_path / "report" / "summary.md").read_text()
    assert "eval" in steps[1] and "auc" in steps[1]["eval"]
    assert sum(steps[-1]["rows_per_ps"]) > 0
    assert "final" in recs[-1]


def test_train_criteo_sample_as_shipped_stops_when_auc_stops_improving(tmp_path):
    """examples/criteo.toml as it is: job.epochs = "auto" (an evaluation at each epoch's end, a stop
    after three without a better AUC: early_stop_patience 3), every sample in every epoch (800 in
    batches of 64: 13 steps an epoch, the last batch completed from the next epoch); the run ends
    with the best evaluation's model (job.restore_best), which the export holds."""
    r = _train(4, ["metrics.progress=false", "metrics.path=", f"data.path={CRITEO}", f"checkpoint.dir={tmp_path / 'ck'}",
                   f"job.export={tmp_path / 'model.npz'}"], config=ROOT / "examples" / "criteo.toml")
    final = _final(r.stdout)
    assert final["exported"] == {"path": str(tmp_path / "model.npz"), "step": final["best"]["step"], "best": True}
    assert final["data"]["train_samples"] == 800 and final["eval_samples"] == 200
    assert 0.4 < final["auc"] <= 1.0 and final["logloss"] < 1.0
    assert final["early_stopped"] and final["steps"] % 13 == 0 and 4 * 13 <= final["steps"] < 50 * 13
    assert final["evaluations"] == final["steps"] // 13 and final["best"]["step"] == final["steps"] - 3 * 13
    assert final["restored_best"] == final["best"]["step"] and final["auc"] == final["best"]["auc"]
    again = _final(_train(3, ["metrics.progress=false", "metrics.path=", f"data.path={CRITEO}",
                              f"checkpoint.dir={tmp_path / 'ck'}", f"job.export={tmp_path / 'again.npz'}"],
                        config=ROOT / "examples" / "criteo.toml").stdout)
    assert again["early_stopped"] and again["steps"] == again["start_step"] == final["steps"]   # a rerun trains no more


def test_streamed_global_batches_do_not_depend_on_the_workers(tmp_path):
    """data.stream_split = batches: 3 workers streaming a plain and a gzipped part train, step by
    step, the global batches one process reads (each sample's number traced by data.trace)."""
    import gzip
    rng = np.random.default_rng(2)
    rows = [f"{rng.integers(0, 2)},{i},u{i % 17},v{i % 5}" for i in range(900)]
    (tmp_path / "part-0.csv").write_text("label,sid,u,v\n" + "\n".join(rows[:400]) + "\n")
    with gzip.open(tmp_path / "part-1.csv.gz", "wt") as f:
        f.write("label,sid,u,v\n" + "\n".join(rows[400:]) + "\n")
    sets = ["metrics.progress=false", "data.format=csv", "job.steps=30", f"data.path={tmp_path / 'part-*'}",
            "data.label=label", "data.dense=sid", "data.reader=stream", "data.stream_split=batches",
            "data.shuffle_buffer=100", "data.hash_rows=50", "data.eval_fraction=0.05"]
    _train(4, sets + [f"data.trace={tmp_path / 'trace'}"])
    traced = {}
    for w in range(3):                                        # worker w's slice of every step
        for line in (tmp_path / f"trace.{w}").read_text().splitlines():
            step, *xs = line.split()
            traced.setdefault(int(step), []).extend(int(float(x)) for x in xs)
    one = make_data(load_config(TINY, sets, environ={}).data, 3, 1, 0)   # job.seed of tiny_ctr.toml
    assert sorted(traced) == list(range(30))                 # 17 steps an epoch: into the second
    for step in range(30):
        assert traced[step] == one.train_batch(step).dense[:, 0].astype(int).tolist(), step


def test_config_error_fails_every_rank_with_one_message():
    """One line for the job, exit 2, and no MPI_Abort line per rank (issue 51.13: at 1,000 ranks a wall)."""
    r = _train(3, ["job.stepz=5"], check=False, timeout=60)
    assert r.returncode == 2
    assert r.stderr.count("hpcps: error: config: unknown key 'job.stepz'") == 1
    assert "Traceback" not in r.stderr and "Abort" not in r.stderr
    assert r.stderr.strip().splitlines() == ["hpcps: error: config: unknown key 'job.stepz' (--set); did you mean 'job.steps'?"]


def test_malformed_data_fails_with_file_and_line(tmp_path):
    bad = tmp_path / "bad.dat"
    bad.write_text("1::1::5\n2::1::4\noops\n")
    r = _train(3, ["data.format=ratings", "model.kind=mf", f"data.path={bad}", "job.epochs=1",
                   "data.batch_size=2"], check=False, timeout=60)
    assert r.returncode != 0
    assert f"{bad}:3: expected 'user item rating" in r.stderr


def test_wait_policy_follows_the_cpus_unless_set():
    """``auto`` sleeps between polls only where the node's ranks outnumber its CPUs (hpcps/core/wait.py)."""
    cpus = len(os.sched_getaffinity(0))
    sets = ["--config", TINY, "--set", "job.steps=3", "metrics.path="]
    for n, cases in ((2, {"auto": None}), (4, {"auto": None, "yield": "yield"})):
        got = train_many(n, {w: (sets, {"HPCPS_WAIT": v}) for w, v in cases.items()})
        for wait in cases:
            final = got[wait][0]
            assert final["node_cpus"] == cpus
            assert final["wait_policy"] == (wait if wait != "auto" else ("sleep" if n > cpus else "yield")), (n, wait)


def test_metrics_and_export_paths_get_their_directories(tmp_path):
    metrics, export = tmp_path / "new" / "m.jsonl", tmp_path / "other" / "w.npz"
    _train(3, ["job.steps=5", f"metrics.path={metrics}", f"job.export={export}"])
    assert metrics.exists() and export.exists()


# the same job as `hpcps train`, from a program that imports hpcps (no restart: glibc's defaults)
_AS_LIBRARY = ("import sys; from hpcps.cli import main; sys.exit(main(sys.argv[1:]))",)


@pytest.mark.parametrize("launch", ["command", "library"])
def test_worker_memory_does_not_grow_with_steps(launch):
    # glibc's tcache fragments a worker's heap under a training step's aligned allocations: the
    # workers grew ~0.35-0.8 MB per step of this job (1.3-2.6 GB after 3000 steps; 140 MB or more
    # from step 100 to 500). `hpcps train`
    # restarts itself with the tcache off; a program of one's own gets a trim every 100 steps
    # (hpcps/core/malloc.py)
    peak = {}
    for steps in (100, 500):
        args = ["train", "--config", ROOT / "examples" / "ctr.toml", "--set", f"job.steps={steps}",
                "metrics.progress=false", "metrics.path=", "job.eval_every=0", "data.eval_samples=1000"]
        r = run_mpi(4, ["-m", "hpcps", *args] if launch == "command" else ["-c", *_AS_LIBRARY, *args], timeout=300,
                    env={"HPCPS_MALLOC_TUNE": None})
        final = _final(r.stdout)
        assert final["malloc"] == ("tcache_off" if launch == "command" else "trim")
        peak[steps] = max(final["memory"]["worker_peak_rss_mb"])
    assert peak[500] - peak[100] < 60, peak


def test_hpcps_train_runs_with_the_tcache_off_unless_told():
    assert _final(_train(2, ["job.steps=3", "metrics.path="], env={"HPCPS_MALLOC_TUNE": None}).stdout)["malloc"] \
        == "tcache_off"
    # (a user's own tunables are kept beside it: tests/test_process.py, the same function)
    assert _final(_train(2, ["job.steps=3", "metrics.path="], env={"HPCPS_MALLOC_TUNE": "0"}).stdout)["malloc"] == "off"


@pytest.mark.parametrize("argv, restart", [
    (["python", "-m", "hpcps", "train", "--config", "x.toml"], True),
    (["python", "-u", "-m", "mpi4py", "-m", "hpcps", "train"], True),
    (["/venv/bin/python", "/venv/bin/hpcps", "--log-level", "info", "train"], True),
    (["python", "-m", "hpcps", "report", "results/"], False),          # no training: no restart
    (["python", "-m", "mpi4py", "-m", "other", "train"], False),
    (["python", "-m", "mpi4py", "prog.py", "hpcps", "train"], False),
    (["python", "-c", "import hpcps", "-m", "hpcps", "train"], False),  # a program that imports hpcps
    (["python", "my_train.py", "train"], False),
    (["python"], False),
])
def test_only_hpcps_train_restarts(argv, restart):
    from hpcps.core import malloc as _malloc
    assert _malloc.wants_restart(argv, {}, {}) is restart
    if restart:
        assert not _malloc.wants_restart(argv, {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}, {})
        assert not _malloc.wants_restart(argv, {"HPCPS_MALLOC_RESTARTED": "1"}, {})     # once only
        assert not _malloc.wants_restart(argv, {"HPCPS_MALLOC_TUNE": "0"}, {})
        assert not _malloc.wants_restart(argv, {}, {"mpi4py.MPI": object()})          # MPI started already


def test_trim_heap_runs_on_glibc_and_can_be_turned_off(monkeypatch):
    from hpcps.core import malloc as _malloc
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(_malloc, "_libc", None)
    assert _malloc.trim_heap() is True                  # glibc (Debian) here and in CI
    assert _malloc.trim_heap() is True
    monkeypatch.setattr(_malloc, "_libc", None)
    monkeypatch.setenv("HPCPS_MALLOC_TUNE", "0")
    assert _malloc.trim_heap() is False
    monkeypatch.delenv("HPCPS_MALLOC_TUNE")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0")     # nothing to trim then
    assert _malloc.trim_heap() is False and _malloc.mode() == "tcache_off"


def test_a_job_warns_once_and_logs_each_evaluation():
    """Issue 51.18: the background-push warning came once per worker; 51.15: an evaluation showed
    only on the bar, the last one never. Now one warning a job, a log line per evaluation."""
    r = _train(4, ["job.steps=20", "job.eval_every=10", "pipeline.background_push=on", "metrics.progress=false"])
    assert r.stderr.count("runs without MPI_THREAD_MULTIPLE") == 1, r.stderr[-3000:]
    assert "hpcps: evaluation after step 10: auc" in r.stderr
    assert "hpcps: done: 20 steps in" in r.stdout and "eval AUC" in r.stdout
