from pathlib import Path

import pytest

from hpcps.config import Config, config_keys, load_config

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_are_the_synthetic_dlrm_job():
    c = load_config(environ={})
    assert (c.data.format, c.model.kind, c.job.mode, c.job.steps) == ("synthetic-ctr", "dlrm", "sync", 3000)


def test_precedence_file_env_set(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[job]\nmode = "async"\nsteps = 7\n[optimizer.sparse]\nlr = 0.5\n')
    c = load_config(f, environ={})
    assert (c.job.mode, c.job.steps, c.optimizer.sparse.lr) == ("async", 7, 0.5)
    env = {"HPCPS_JOB_STEPS": "9", "HPCPS_MODE": "ssp:2", "HPCPS_OPTIMIZER_SPARSE_LR": "0.25", "HPCPS_NUM_PS": "2"}
    c = load_config(f, environ=env)
    assert (c.job.mode, c.job.steps, c.optimizer.sparse.lr, c.job.num_ps) == ("ssp:2", 9, 0.25, 2)
    c = load_config(f, ["job.steps=11", "job.mode=sync", "model.top_mlp=8,4"], environ=env)
    assert (c.job.mode, c.job.steps, c.model.top_mlp) == ("sync", 11, [8, 4])


@pytest.mark.parametrize("text,msg", [
    ('[job]\nstepz = 3\n', "unknown key 'job.stepz' \\(file .*did you mean 'job.steps'"),
    ('[jobs]\nsteps = 3\n', "unknown key 'jobs.steps'"),
    ('[job]\nsteps = "many"\n', "job.steps = 'many' .*expected int"),
    ('[job]\nsteps = 1.5\n', "job.steps = 1.5 .*expected int, got float"),
    ('[data]\nskip_bad_lines = 1\n', "expected bool"),
    ('[job\n', "not valid TOML"),
])
def test_file_errors_name_the_key(tmp_path, text, msg):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ValueError, match=msg):
        load_config(f, environ={})


@pytest.mark.parametrize("sets,msg", [
    (["job.mode=fast"], "job.mode = 'fast'"),
    (["job.mode=ssp:x"], "ssp:S"),
    (["job.num_ps=0"], "job.num_ps = 0: must be >= 1"),
    (["data.batch_size=0"], "data.batch_size"),
    (["data.format=parquet"], "data.format = 'parquet': must be one of"),
    (["data.format=criteo"], "data.path = '': format criteo needs a file"),
    (["data.format=criteo", "data.path=/nope.txt"], "data.path = '/nope.txt': no such file"),
    (["model.kind=mf"], "mf needs data.format = ratings"),
    (["optimizer.sparse.name=lamb"], "unknown sparse optimizer 'lamb'"),
    (["optimizer.dense.name=lamb"], "optimizer.dense.name = 'lamb'"),
    (["optimizer.sparse.schedule=wavy"], "schedule kind"),
    (["model.dense_backend=ucc"], "model.dense_backend = 'ucc': must be auto, shm, mpi, gloo or nccl"),
    (["model.device=cuda", "model.dense_backend=gloo"], "gloo all-reduces CPU tensors"),
    (["model.device=cuda", "model.dense_backend=shm"], "shm all-reduces CPU tensors"),
    (["model.threads=-2"], "model.threads = -2: must be >= 0"),
    (["checkpoint.keep_best=rmse", "checkpoint.dir=/tmp/x"],
     "checkpoint.keep_best = 'rmse': must be auc or logloss for ctr data"),
    (["checkpoint.keep_best=auc"], "checkpoint.keep_best = 'auc': needs checkpoint.dir"),
    (["job.early_stop_patience=3"], "job.early_stop_patience = 3: needs evaluations during training"),
    (["job.export_best=true", "job.export=w.npz"],
     "job.export_best = True: needs job.export (where to) and checkpoint.keep_best"),
    (["model.init=xavier"], "model.init = 'xavier': must be one of auto, uniform, normal, zeros"),
    (["model.init_scale=-1"], "model.init_scale = -1.0: must be finite and >= 0"),
    (["model.embedding_l2=nan"], "model.embedding_l2 = nan"),
    (["model.dropout=1"], "model.dropout = 1.0: must be in .0, 1)"),
    (["optimizer.sparse.l1=0.1"], "l1, l2 and ftrl_beta are FTRL's, and the optimizer is 'adagrad'"),
    (["optimizer.sparse.name=ftrl", "optimizer.sparse.ftrl_beta=0"], "would divide by 0"),
    (["job.steps"], "--set takes key=value"),
    (["job.steps=0"], "synthetic data is endless"),
    (["checkpoint.dir_mode=rwx"], "checkpoint.dir_mode = 'rwx': must be an octal permission"),
    (["checkpoint.file_mode=0o1777"], "checkpoint.file_mode = '0o1777'"),
    (["pipeline.cache_rows=100"], "pipeline.cache_rows = 100: a cache serves rows up to"),
    (["pipeline.cache_rows=-1", "job.mode=async"], "pipeline.cache_rows = -1: must be >= 0"),
    (["pipeline.cache_staleness=-2"], "pipeline.cache_staleness = -2"),
    (["pipeline.prefetch=maybe"], "pipeline.prefetch = 'maybe': must be auto, on or off"),
    (["pipeline.push_dtype=int8"], "pipeline.push_dtype = 'int8': must be one of float32, bfloat16, float16"),
    (["job.wait=spin"], "job.wait = 'spin': must be one of auto, yield, sleep"),
    (["optimizer.sparse.lr=1e39"], "lr must be a number in .0, 3.403e.38. .rows are float32"),
    (["job.rma_read=put"], "job.rma_read = 'put': must be one of auto, get_accumulate, get"),
    (["job.mpi_threads=all"], "job.mpi_threads = 'all': must be one of single, funneled, serialized, multiple"),
    (["model.sharding=hash"], "model.sharding = 'hash': must be one of modulo, range"),
    (["job.world_size=-1"], "job.world_size = -1"),
    (["job.step_delay=-0.5"], "job.step_delay = -0.5"),
])
def test_bad_values_name_the_key(sets, msg):
    with pytest.raises(ValueError, match=msg.replace("(", "\\(").replace(")", "\\)")):
        load_config(None, sets, environ={})


def test_env_error_names_the_variable():
    with pytest.raises(ValueError, match="environment HPCPS_DATA_BATCH_SIZE"):
        load_config(None, environ={"HPCPS_DATA_BATCH_SIZE": "big"})


@pytest.mark.parametrize("name", ["ctr.toml", "criteo.toml", "ratings.toml"])
def test_examples_load(name, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    sets = []
    if name == "ratings.toml":
        (tmp_path / "r.dat").write_text("1::1::5::0\n")
        sets = [f"data.path={tmp_path / 'r.dat'}"]
    c = load_config(ROOT / "examples" / name, sets, environ={})
    assert isinstance(c, Config)


def test_every_key_is_documented_in_help_and_the_reference():
    import re
    import subprocess
    import sys

    from hpcps.config import ENV_ALIASES
    out = subprocess.run([sys.executable, "-m", "hpcps", "train", "--help"], capture_output=True, text=True,
                         check=True).stdout
    readme = (ROOT / "README.md").read_text()
    reference = (ROOT / "docs" / "configuration.md").read_text()
    assert "docs/configuration.md" in readme
    for key in config_keys():
        section, _, name = key.rpartition(".")
        block = re.search(rf"^  {re.escape(section)}: (.*(?:\n {{5,}}.*)*)", out, re.M)
        assert block and re.search(rf"(^|\s){name}=", block.group(1)), key
        assert f"`{key}`" in reference, f"docs/configuration.md does not list {key}"
    for env in ENV_ALIASES:                       # the README points to the reference for them
        assert f"`{env}`" in reference, f"docs/configuration.md does not list {env}"


def test_pipeline_switches_take_toml_booleans_and_words(tmp_path):
    from hpcps.config import resolve_switch
    f = tmp_path / "c.toml"
    f.write_text("[pipeline]\nprefetch = false\nbackground_push = true\n")
    c = load_config(f, environ={})
    assert (c.pipeline.prefetch, c.pipeline.background_push) == ("off", "on")
    assert resolve_switch("auto", True) and not resolve_switch("auto", False)
    assert resolve_switch("ON", False) and not resolve_switch("no", True)


def test_former_environment_only_settings_are_keys_with_their_old_names():
    env = {"HPCPS_WAIT": "sleep", "HPCPS_RMA_READ": "get", "HPCPS_MPI_THREADS": "multiple",
           "HPCPS_MALLOC_TUNE": "0", "HPCPS_STEP_DELAY": "0.25", "HPCPS_WORLD_SIZE": "4",
           "HPCPS_NCCL_HOST": "10.1.2.3"}
    c = load_config(None, [], environ=env)
    assert (c.job.wait, c.job.rma_read, c.job.mpi_threads, c.job.malloc_tune, c.job.step_delay, c.job.world_size,
            c.model.nccl_host) == ("sleep", "get", "multiple", False, 0.25, 4, "10.1.2.3")
    c = load_config(None, ["job.wait=yield"], environ=env)            # --set wins over the environment
    assert c.job.wait == "yield"


@pytest.mark.parametrize("toml,msg", [
    ('[job]\nsteps = "10"\n', "job.steps = '10' .*expected int, got a string .write it without quotes"),
    ('[model]\nbottom_mlp = "64"\n', "model.bottom_mlp = '64'.*expected list"),
    ('[data]\nbatch_size = 12.5\n', "data.batch_size = 12.5.*expected int, got float"),
])
def test_toml_values_of_the_wrong_type_are_refused_not_converted(tmp_path, toml, msg):
    f = tmp_path / "c.toml"
    f.write_text(toml)
    with pytest.raises(ValueError, match=msg):
        load_config(f, environ={})


@pytest.mark.parametrize("sets,msg", [
    (["model.dim=1_000"], "model.dim = '1_000'.*expected int"),
    (["checkpoint.every_steps=10"], "checkpoint.every_steps = 10: needs checkpoint.dir"),
    (["checkpoint.every_seconds=60"], "checkpoint.every_seconds = 60.0: needs checkpoint.dir"),
])
def test_settings_that_would_be_silently_odd_are_refused(sets, msg):
    with pytest.raises(ValueError, match=msg):
        load_config(None, sets, environ={})


def test_checkpoint_dir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "ck"
    f.write_text("")
    with pytest.raises(ValueError, match="checkpoint.dir = .*is a file, not a directory"):
        load_config(None, [f"checkpoint.dir={f}"], environ={})


@pytest.mark.parametrize("sets,num_ps,want", [
    ([], 1, 1),                                                 # the main job: 11 MB a shard, every one full
    (["data.rows_per_table=1000000"], 1, 10),                   # 8 x 1M rows + Adagrad state: 1 GB, deltas
    (["data.rows_per_table=1000000"], 16, 1),                   # the same over 16 PS: 64 MiB each
    (["data.rows_per_table=1000000", "optimizer.sparse.name=sgd"], 8, 1),    # no state: 64 MB over 8
    (["data.rows_per_table=1000000", "optimizer.sparse.name=adam"], 8, 10),  # two state arrays: 192 MB
    (["checkpoint.local_full_every=4"], 1, 4),                  # a number is kept
    (["model.dynamic_tables=true", "model.dynamic_capacity=100000000"], 4, 10),
])
def test_local_full_every_auto_is_all_full_for_small_shards(tmp_path, sets, num_ps, want):
    from types import SimpleNamespace

    from hpcps.train.tables import resolve_local_full_every
    cfg = load_config(ROOT / "examples" / "ctr.toml", sets + [f"checkpoint.dir={tmp_path}", "checkpoint.local_every=10",
                                                            f"checkpoint.local_dir={tmp_path / 'local'}"], environ={})
    data = SimpleNamespace(tables=[(f"cat{i}", cfg.data.rows_per_table) for i in range(cfg.data.num_tables)])
    got = resolve_local_full_every(cfg, data, cfg.job.steps, num_ps)
    assert got.checkpoint.local_full_every == want
    assert got.job == cfg.job and got.model == cfg.model          # nothing else changed
    off = load_config(ROOT / "examples" / "ctr.toml", [], environ={})   # no node-local level: left as it is
    assert resolve_local_full_every(off, data, off.job.steps, num_ps).checkpoint.local_full_every == 0


def test_epochs_auto_from_a_file_or_set_and_the_model_kinds(tmp_path):
    from hpcps.config import AUTO_EPOCHS
    from hpcps.models import kinds
    data = tmp_path / "d.txt"
    data.write_text("0\t1" + "\t" * 38 + "\n")
    f = tmp_path / "c.toml"
    f.write_text(f'[job]\nepochs = "auto"\n[data]\nformat = "criteo"\npath = "{data}"\n')
    assert load_config(f, environ={}).job.epochs == AUTO_EPOCHS
    assert load_config(f, ["job.epochs=3"], environ={}).job.epochs == 3
    assert load_config(f, ["job.epochs=AUTO"], environ={}).job.epochs == AUTO_EPOCHS
    for bad in ("-2", "-1"):                     # -1 is how "auto" is kept: not a value to write
        with pytest.raises(ValueError, match=rf"job.epochs = '{bad}' \(--set\): must be >= 0 or \"auto\""):
            load_config(f, [f"job.epochs={bad}"], environ={})
    with pytest.raises(ValueError, match="job.max_epochs = 0"):
        load_config(f, ["job.epochs=auto", "job.max_epochs=0"], environ={})
    # every registered kind is a valid model.kind; an unknown one names them all
    assert set(kinds()) >= {"lr", "wide_deep", "deepfm", "dcn", "dlrm", "mf"}
    for k in ("lr", "wide_deep", "deepfm", "dcn", "dlrm"):
        assert load_config(f, [f"model.kind={k}"], environ={}).model.kind == k
    with pytest.raises(ValueError, match="model.kind = 'xdeepfm': must be one of") as e:
        load_config(f, ["model.kind=xdeepfm"], environ={})
    assert all(k in str(e.value) for k in kinds())

    # what a kind needs of the other keys: checked by hpcps train at start (the kind's registration says)
    from hpcps.train.tables import check_model_kind
    with pytest.raises(ValueError, match="model.dropout = 0.1: a lr model has no MLP"):
        check_model_kind(load_config(f, ["model.kind=lr", "model.dropout=0.1"], environ={}))
    with pytest.raises(ValueError, match="model.dynamic_tables = True: needs a kind of embeddings only"):
        check_model_kind(load_config(f, ["model.kind=wide_deep", "model.dynamic_tables=true"], environ={}))
    check_model_kind(load_config(f, ["model.kind=dcn", "model.dynamic_tables=true"], environ={}))
    from hpcps.config.schema import MODELS
    assert set(MODELS) == set(kinds())             # the config's list is the registry's


def test_column_names_with_underscores_come_through_set(tmp_path):
    """`--set data.drop=attributed_time,click_time`: an underscore is refused in a number (1_000)
    only, not in a column name."""
    data = tmp_path / "d.csv"
    data.write_text("click,attributed_time,click_time,app\n0,,1,2\n")
    c = load_config(None, ["data.format=csv", f"data.path={data}", "data.label=click",
                           "data.drop=attributed_time,click_time"], environ={})
    assert c.data.drop == ["attributed_time", "click_time"]
    with pytest.raises(ValueError, match="job.steps = '1_000'"):
        load_config(None, ["job.steps=1_000"], environ={})


def test_tensorboard_without_the_package_is_a_clear_error(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "tensorboard", None)          # as if not installed
    with pytest.raises(ValueError, match=r"metrics.tensorboard = '/tmp/tb': needs the tensorboard package"):
        load_config(None, ["metrics.tensorboard=/tmp/tb"], environ={})


def test_a_saved_config_keeps_auto_epochs():
    """A checkpoint's config (to_dict) holds job.epochs = "auto" as -1: loading it back (hpcps predict,
    evaluate, the exports) is "auto", while a user's -1 is refused."""
    from hpcps.config import AUTO_EPOCHS
    saved = load_config(None, ["job.epochs=auto", "data.format=csv", f"data.path={ROOT / 'README.md'}",
                               "data.label=0"], environ={}).to_dict()
    assert saved["job"]["epochs"] == AUTO_EPOCHS
    assert load_config(None, [], environ={}, base=saved).job.epochs == AUTO_EPOCHS
