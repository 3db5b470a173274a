"""``hpcps tune``: the space checked before any trial, the best config written as TOML that loads
back to the same config, and the README's search on the bundled Criteo sample, killed -9 in a
trial and run again: it goes on with the same study (its job-array form is in test_slurm.py)."""

import functools
import json
import signal
import subprocess
import sys
import time

import pytest

from hpcps.config import config_keys, load_config
from hpcps.config.space import as_set, parse_space
from hpcps.tune import toml_text
from mpirun import ROOT

CRITEO = ROOT / "examples" / "criteo.toml"
# the README's command, smaller: 3 trials of at most 3 epochs over 2,000-row tables
SMALL = ["tune.trials=3", "job.max_epochs=3", "data.hash_rows=2000", "tune.ranks=3"]


@pytest.mark.parametrize("space,message", [
    ({"optimizer.wide.lrr": [0.1]}, "not a key hpcps train takes"),
    ({"tune.trials": [1, 2]}, "not a key hpcps train takes"),
    ({"model.kind": []}, "an empty list of choices"),
    ({"optimizer.wide.lr": {"low": 1.0, "high": 0.1}}, "low < high"),
    ({"optimizer.wide.lr": {"low": 0.0, "high": 1.0, "log": True}}, "log range needs low > 0"),
    ({"optimizer.wide.lr": {"low": 0.1}}, "expected a list of choices or"),
    ({"optimizer.wide.lr": 0.3}, "expected a list of choices or"),
])
def test_a_bad_space_is_refused_naming_the_entry(space, message):
    with pytest.raises(ValueError, match=message):
        parse_space(space, config_keys())
    with pytest.raises(ValueError, match="tune.space"):             # the config's own check
        load_config(None, [f"tune.space={json.dumps(space)}"], environ={})


def test_a_value_the_config_refuses_stops_the_search_before_any_trial(tmp_path):
    study = tmp_path / "study"
    r = subprocess.run([sys.executable, "-m", "hpcps", "tune", "--config", CRITEO, "--set", f"tune.study={study}",
                        'tune.space={"model.kind": ["lr", "wide_deeep"]}'], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "model.kind = 'wide_deeep'" in r.stderr
    assert not study.exists()                   # nothing ran, nothing was written


def test_a_choice_becomes_a_set_and_the_best_config_loads_back_the_same(tmp_path):
    dims = parse_space({"model.top_mlp": [[64, 32], []], "job.early_stop_patience": {"low": 1, "high": 4},
                        "optimizer.wide.lr": {"low": 0.01, "high": 1, "log": True}}, config_keys())
    assert [d.integer for d in dims] == [False, True, False] and dims[0].choices == ("[64, 32]", "[]")
    assert as_set("model.top_mlp", "[64, 32]") == "model.top_mlp=64,32" and as_set("job.export_best", True) == \
        "job.export_best=true"
    cfg = load_config(CRITEO, [as_set("model.top_mlp", "[64, 32]"), "data.categorical=C1,C2", 'data.label=0',
                               "checkpoint.dir=a \"quoted\" dir"], environ={})
    path = tmp_path / "best.toml"
    path.write_text(toml_text(cfg, "a header"))
    back = load_config(path, environ={}).to_dict()
    want = cfg.to_dict()
    back.pop("tune"), want.pop("tune")
    assert back == want and back["job"]["epochs"] == -1 and back["model"]["top_mlp"] == [64, 32]


def _tune(study, *extra, wait=True):
    argv = [sys.executable, "-m", "hpcps", "tune", "--config", str(CRITEO), "--set", f"tune.study={study}", *SMALL,
            *extra]
    if not wait:
        return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _trains(study) -> list:
    r = subprocess.run(["pgrep", "-f", f"checkpoint.dir={study}"], capture_output=True, text=True)
    return r.stdout.split()


def test_the_readme_search_killed_in_a_trial_goes_on_when_run_again(tmp_path):
    import optuna
    study = tmp_path / "study"
    first = _tune(study, wait=False)
    t0 = time.time()
    while not (study / "trial-0001" / "train.log").exists() and time.time() - t0 < 300:   # the second trial runs
        assert first.poll() is None, first.communicate()[1][-3000:]
        time.sleep(0.2)
    time.sleep(2)
    assert _trains(study), "the second trial's ranks should be running"
    first.send_signal(signal.SIGKILL)
    assert first.wait(30) == -signal.SIGKILL                 # the search itself was killed, mid-trial
    t0 = time.time()
    while _trains(study) and time.time() - t0 < 30:      # the trial's launcher dies with the search
        time.sleep(0.5)
    assert not _trains(study), "a killed search left its trial running"
    again = _tune(study)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "left running by a search that ended" in again.stderr
    out = json.loads(again.stdout.strip().splitlines()[-1])["tune"]
    assert out["complete"] + out["pruned"] == 3 and out["failed"] == 1 and out["trials"] == 4
    st = optuna.load_study(study_name="hpcps", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(study / "journal.log"))))
    first = st.trials[0]                                  # the config's own values come first
    assert first.user_attrs.get("config") and first.params["optimizer.wide.lr"] == 0.03
    assert first.params["model.kind"] == "wide_deep" and len(first.params) == 7
    failed = [t for t in st.trials if t.state.name == "FAIL"]
    retried = [t for t in st.trials if t.user_attrs.get("retry_of") == failed[0].number]
    assert failed[0].number == 1 and retried and retried[0].params == failed[0].params     # tried again
    best = max((t for t in st.trials if t.value is not None), key=lambda t: t.value)
    assert out["best"]["trial"] == best.number and out["best"]["auc"] == pytest.approx(best.value)
    tuned = load_config(study / "best.toml", environ={})                 # hpcps train --config best.toml
    for key, value in best.params.items():
        got = functools.reduce(getattr, key.split("."), tuned)
        assert got == pytest.approx(value) if isinstance(value, float) else str(got) == str(value)
    table = (study / "trials.md").read_text()
    assert table.count("| complete |") + table.count("| pruned |") == 3 and "| fail |" in table
    assert (study / "tune.png").stat().st_size > 1000
    assert not _trains(study) and not any((study / f"trial-{i:04d}" / "checkpoints").exists() for i in range(4))
    # run once more: the study is done, nothing runs
    done = _tune(study)
    assert done.returncode == 0 and json.loads(done.stdout.strip().splitlines()[-1])["tune"]["trials"] == 4


def test_a_trial_another_search_has_just_taken_is_not_judged_stale(tmp_path, monkeypatch):
    """Two tasks of a job array: one takes the queued trial 0 and, before it has written its host,
    pid and heartbeat, the other starts and looks for trials of dead searches. Trial 0 was started
    a moment ago: it is left running (it was marked failed, and the first task's result refused).
    Silent for longer than STALE_S on another host, it is failed and its values queued again."""
    import types
    from optuna.trial import TrialState
    from hpcps.tune import study as tune_study
    study = tune_study.open_study(tmp_path / "study", maximise=True)
    study.enqueue_trial({"x": 1.0})
    taken = study.ask()                                   # RUNNING, no user attributes yet
    assert tune_study.recover_stale(tune_study.open_study(tmp_path / "study", maximise=True)) == 0
    assert study.trials[taken.number].state == TrialState.RUNNING
    taken.set_user_attr("host", "another-node")
    later = time.time() + tune_study.STALE_S + 60
    monkeypatch.setattr(tune_study, "time", types.SimpleNamespace(time=lambda: later))
    assert tune_study.recover_stale(tune_study.open_study(tmp_path / "study", maximise=True)) == 1
    states = [t.state for t in study.trials]
    assert states == [TrialState.FAIL, TrialState.WAITING] and study.trials[1].user_attrs["retry_of"] == 0


def test_cross_validated_trials_train_once_a_fold_and_score_the_mean(tmp_path):
    """``tune.folds = 2``: the sample's lines dealt into two folds once (each line in one held-out
    file, the training file of a fold the other's lines); each trial trains twice and its value is
    the mean of its two final AUCs; the best config names the user's data, not a fold."""
    import optuna
    study = tmp_path / "study"
    r = _tune(study, "tune.trials=2", "tune.folds=2", "job.max_epochs=2")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = sorted((ROOT / "tests" / "data" / "criteo_head1000.txt").read_text().splitlines())
    held = [(study / "folds" / f"held-{i}").read_text().splitlines() for i in range(2)]
    train = [(study / "folds" / f"train-{i}").read_text().splitlines() for i in range(2)]
    assert sorted(held[0] + held[1]) == lines and len(held[0]) == 500
    assert sorted(train[0]) == sorted(held[1]) and sorted(train[1]) == sorted(held[0])
    st = optuna.load_study(study_name="hpcps", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(study / "journal.log"))))
    for t in st.trials:
        assert t.state.name == "COMPLETE" and len(t.user_attrs["folds"]) == 2
        assert t.value == pytest.approx(sum(t.user_attrs["folds"]) / 2, abs=1e-5)
        for i in range(2):
            log = (study / f"trial-{t.number:04d}" / f"fold-{i}" / "train.log").read_text()
            assert f"data.path={study / 'folds' / f'train-{i}'}" in log.splitlines()[0]
    tuned = load_config(study / "best.toml", environ={})
    assert tuned.data.path == "tests/data/criteo_head1000.txt" and not tuned.data.eval_path


@pytest.mark.parametrize("sets,message", [
    (["tune.folds=1"], "tune.folds = 1: must be 0 (one eval split) or >= 2"),
    (["tune.folds=3", "data.eval_path=tests/data/criteo_head1000.txt"], "set data.eval_path = \"\""),
    (["tune.folds=3", "data.path=tests/data"], "must be one file"),
])
def test_folds_that_cannot_be_cut_are_refused_before_any_trial(tmp_path, sets, message):
    r = _tune(tmp_path / "study", *sets)
    assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]
    assert not list((tmp_path / "study").glob("trial-*"))
