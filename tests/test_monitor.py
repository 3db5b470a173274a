"""The monitor (issue 41): per-host records, the alert rules, on_alert = checkpoint_and_stop and
its restart with the suggested layout; the rules' arithmetic on made-up boards."""

import json
import subprocess
import types

import numpy as np
import pytest

from hpcps.monitor.fields import FIELDS, PS, WORKER, at, per_ps
from hpcps.monitor.rules import host_records, judge, suggest_num_ps
from mpirun import ROOT, run_mpi

TINY = ROOT / "tests" / "configs" / "tiny_ctr.toml"
MON = types.SimpleNamespace(memory=0.9, node_memory_mb=0, disk_checkpoints=2.0, ps_busy=0.8, ps_wait=0.3,
                            straggler=1.5, silent=3.0, on_alert="log")


def _records(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def _mount_small(where, mb: int) -> bool:
    """A tmpfs of ``mb`` MB at ``where`` (root only); False where it cannot be mounted."""
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(where)], capture_output=True)
    return r.returncode == 0


@pytest.mark.openmpi
def test_an_overloaded_ps_raises_an_alert_and_stops_for_a_restart_with_more_ps(tmp_path):
    """A PS whose applies take 30 ms more (1 PS + 2 workers, sync): ALERT naming the PS, its rank and
    host, and --set job.num_ps=2. on_alert = checkpoint_and_stop: a checkpoint, exit 85; the restart
    with the suggested layout trains to the end with no PS alert."""
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    sets = ["--config", TINY, "--set", f"checkpoint.dir={ck}", "--set", "metrics.every=0.3", "--set",
            f"metrics.path={m}", "--set", "job.steps=400"]
    r = run_mpi(3, ["monitor_cases.py", "slow_ps", *sets, "--set", "monitor.on_alert=checkpoint_and_stop"],
                timeout=180, check=False)
    assert r.returncode == 85, r.stderr[-3000:]
    alerts = [x for x in r.stderr.splitlines() if "hpcps: ALERT" in x]
    assert len(alerts) == 1 and "PS overloaded: the workers wait on PS 0 (rank 2, host" in alerts[0], alerts
    assert "monitor.on_alert = checkpoint_and_stop, after the ps_overloaded alert" in r.stderr
    recs = _records(m)
    final = recs[-1]["final"]
    assert final["stopped"] and final["saved"] and final["stopped_by_alert"] == "ps_overloaded"
    n = final["alerts"][0]["suggest_num_ps"]
    assert [a["alert"] for a in final["alerts"]] == ["ps_overloaded"] and n >= 2 and f"--set job.num_ps={n}" in alerts[0]
    assert final["steps"] < 400 and json.loads((ck / "STOPPED").read_text())["alert"]["rule"] == "ps_overloaded"
    assert json.loads((ck / "LAYOUT").read_text())["job.num_ps"] == n        # slurm/train.sbatch follows it
    r = run_mpi(3, ["monitor_cases.py", "plain", *sets, "--set", "job.num_ps=2"], timeout=180)
    final = json.loads(r.stdout.splitlines()[-1])["final"]
    assert final["steps"] == 400 and final["num_ps"] == 2 and not final["stopped"] and final["alerts"] == []


def test_a_growing_rank_and_a_small_disk_raise_alerts_and_the_report_plots_hosts_and_ps(tmp_path):
    """Worker 0 grows by 8 MB a step against monitor.node_memory_mb = 1100: an ALERT naming rank 0,
    its resident memory and how fast it grows. checkpoint.dir on a 12 MB filesystem, under two
    checkpoints' worth of the tables (7.7 MB each): a disk alert. The run goes on (on_alert = log).
    hpcps report then draws each host's CPU and memory and each PS's busy share over time."""
    small = tmp_path / "small"
    mounted = _mount_small(small, 12)
    env = {} if mounted else {"HPCPS_TEST_DISK_FREE": str(12e6)}
    m = tmp_path / "m.jsonl"
    try:
        r = run_mpi(2, ["monitor_cases.py", "growing", "--config", TINY, "--set", "job.steps=150", "--set",
                        "job.step_delay=0.01", "--set", "metrics.every=0.3", "--set", f"metrics.path={m}", "--set",
                        "monitor.node_memory_mb=1100", "--set", "data.rows_per_table=20000", "--set", "model.dim=16",
                        "--set", f"checkpoint.dir={small / 'ck'}"], env=env, timeout=180)
    finally:
        if mounted:
            subprocess.run(["umount", str(small)], check=False)
    alerts = [x for x in r.stderr.splitlines() if "hpcps: ALERT" in x]
    mem = [x for x in alerts if "memory: host" in x]
    assert len(mem) == 1 and "rank 0 holds the most" in mem[0] and "MB/min" in mem[0], alerts
    disk = [x for x in alerts if "disk: checkpoint.dir" in x]
    assert len(disk) == 1 and "under 2 checkpoints (15.4 MB)" in disk[0], alerts
    recs = _records(m)
    used = [x["mem_used_mb"] for x in recs if "monitor" in x]
    assert used[-1] > 990 > used[0], used
    final = recs[-1]["final"]
    assert final["steps"] == 150 and sorted(a["alert"] for a in final["alerts"]) == ["disk", "memory"]
    out = tmp_path / "report"
    subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-m", "hpcps", "report", str(m), "--out", str(out)],
                   check=True, capture_output=True, timeout=120)
    assert (out / "hosts.png").stat().st_size > 5000 and (out / "ps_busy.png").stat().st_size > 5000
    summary = (out / "summary.md").read_text()
    assert "ALERT at step" in summary and "memory: host" in summary


def _board(n: int, num_ps: int) -> np.ndarray:
    rows = np.full((n, len(FIELDS) + 2 * num_ps), np.nan)
    rows[:, at("seq")] = 1
    return rows


def _set(rows, r, **kw):
    for k, v in kw.items():
        if k in ("wait_ps", "bytes_ps"):
            rows[r, per_ps(k, (rows.shape[1] - len(FIELDS)) // 2)] = v
        else:
            rows[r, at(k)] = v


def test_a_straggler_host_and_a_silent_rank_are_named():
    """Four hosts of one PS and one worker each: the worker on host 3 works 3x as long a step as the
    others (a straggler); a rank whose row stopped is silent. Nothing else alerts."""
    rows = _board(8, 4)
    host_of = [0, 0, 1, 1, 2, 2, 3, 3]
    names = ["a", "b", "c", "d"]
    ps_ranks = [0, 2, 4, 6]
    for r in range(8):
        _set(rows, r, rss=3e8, mem_used=4e9, mem_limit=16e9, cpu_proc=0.9, cpu_node=0.5)
        if r in ps_ranks:
            _set(rows, r, role=PS, busy=0.3, apply=0.3, rows_s=1e5)
        else:
            _set(rows, r, role=WORKER, steps=100, step_s=0.012, compute_s=0.004 if r != 7 else 0.012,
                 rpc_s=0.001, wait_ps=[0.001] * 4)
    hosts = host_records(rows, host_of, names, ps_ranks)
    assert [h["host"] for h in hosts] == names and hosts[3]["workers"]["compute_ms"] == 12.0
    alerts = judge(rows, hosts, host_of, names, ps_ranks, MON, {}, [(5, 40.0)])
    assert [(a["rule"], a["rank"], a["host"]) for a in alerts] == [("straggler", 7, "d"), ("silent", 5, "c")]
    assert "3.0x the median host's 4.0 ms" in alerts[0]["message"]


def _final(stdout):
    return [json.loads(x)["final"] for x in stdout.splitlines() if x.startswith('{"final"')][-1]


@pytest.mark.openmpi
def test_rebalance_makes_a_standby_a_second_ps_while_the_job_runs(tmp_path):
    """1 PS + 2 workers + 1 standby, the PS short of CPU (each row it applies takes 0.2 ms more):
    monitor.on_alert = rebalance. The overload alert makes the standby a second PS from the stop's
    checkpoint, in the same processes; if the PS are still overloaded with no standby left, the job
    stops with its checkpoint (exit 85) for a restart with the layout it asks for."""
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    sets = ["--config", TINY, "--set", f"checkpoint.dir={ck}", "metrics.every=0.3", f"metrics.path={m}",
            "job.steps=400", "monitor.on_alert=rebalance", "job.standby=1", "job.log_every=10"]
    r = run_mpi(4, ["monitor_cases.py", "slow_rows", *sets], env={"HPCPS_TEST_ROW_DELAY": "2e-4"}, timeout=180,
                check=False)
    assert r.returncode in (0, 85), r.stderr[-3000:]
    f = _final(r.stdout)
    assert f["num_ps"] == 2 and f["recoveries"][0]["rebalanced_to_num_ps"] == 2, f.get("recoveries")
    assert f["recoveries"][0]["standbys_taking_over"] == [3] and "1 standby rank becomes PS (2 PS in all)" in r.stderr
    starts = [rec["start"]["run"] for rec in _records(m) if "start" in rec]
    assert len(starts) == 2 and starts[0].split("-")[-1] == starts[1].split("-")[-1]   # same worker 0 process
    if r.returncode == 85:                                    # overloaded again, no standby left
        assert "no standby is left" in r.stderr and json.loads((ck / "LAYOUT").read_text())["job.num_ps"] > 2
    else:
        assert f["steps"] == 400 and not (ck / "STOPPED").exists()


def test_a_rebalance_file_adds_a_ps_from_a_standby_and_standbys_without_ulfm_say_what_they_do(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "REBALANCE").touch()                                # seen at the first step boundary
    r = run_mpi(4, ["-m", "hpcps", "train", "--config", TINY, "--set", f"checkpoint.dir={ck}", "job.steps=40",
                    "job.standby=1"], timeout=120)
    f = _final(r.stdout)
    assert f["steps"] == 40 and f["num_ps"] == 2 and f["recoveries"][0]["rebalanced_to_num_ps"] == 2
    assert not (ck / "REBALANCE").exists() and "rebalance requested (the file" in r.stderr
    assert "for rebalancing only" in r.stderr and "--with-ft ulfm" in r.stderr    # MPICH: no live failover


def test_the_overload_rule_needs_both_a_busy_ps_and_waiting_workers_and_sizes_the_layout():
    rows = _board(4, 2)
    host_of, names, ps_ranks = [0, 0, 0, 0], ["h"], [0, 1]
    _set(rows, 0, role=PS, busy=0.97, apply=0.95, rows_s=1e6)
    _set(rows, 1, role=PS, busy=0.5, apply=0.5, rows_s=5e5)
    for r in (2, 3):
        _set(rows, r, role=WORKER, steps=10, step_s=0.01, compute_s=0.003, rpc_s=0.0, wait_ps=[0.005, 0.0],
             bytes_ps=[2e6, 1e6])
    hosts = host_records(rows, host_of, names, ps_ranks)
    assert [(p["ps"], p["busy"], p["mb_s"]) for p in hosts[0]["ps"]] == [(0, 0.97, 4.0), (1, 0.5, 2.0)]
    alerts = judge(rows, hosts, host_of, names, ps_ranks, MON, {}, [])
    # the workers wait 50% of their step on PS 0: 2 PS x 0.5 / 0.2 -> 5
    assert [(a["rule"], a["rank"], a["suggest_num_ps"]) for a in alerts] == [("ps_overloaded", 0, 5)]
    assert "--set job.num_ps=5 (and 3 more ranks to keep the workers)" in alerts[0]["message"]
    _set(rows, 2, wait_ps=[0.001, 0.0])
    _set(rows, 3, wait_ps=[0.001, 0.0])          # busy, but the workers hardly wait: no alert
    assert judge(rows, host_records(rows, host_of, names, ps_ranks), host_of, names, ps_ranks, MON, {}, []) == []
    assert suggest_num_ps([0.95, 0.95, 0.95], 3) == 5 and suggest_num_ps([0.95, 0.95, 0.9], 3) == 4 and suggest_num_ps([0.2], 1) == 2
    assert suggest_num_ps([0.58], 1, 0.54, 0.2) == 3


def test_a_sync_ps_that_holds_the_workers_back_alerts_though_it_is_never_busy_90_percent():
    """Issue 51.9: a sync PS idles while its workers compute. Busy 58% while the workers wait 54% of
    each step on it raised nothing; it is the cause of their wait, so it alerts. The same wait with
    the PS busy 20% (a slow link, another worker) does not: more PS would not help."""
    rows = _board(3, 1)
    host_of, names, ps_ranks = [0, 0, 0], ["h"], [0]
    _set(rows, 0, role=PS, busy=0.58, apply=0.55, rows_s=1e6)
    for r in (1, 2):
        _set(rows, r, role=WORKER, steps=10, step_s=0.01, compute_s=0.004, rpc_s=0.0, wait_ps=[0.0054], bytes_ps=[1e6])
    alerts = judge(rows, host_records(rows, host_of, names, ps_ranks), host_of, names, ps_ranks, MON, {}, [])
    assert [(a["rule"], a["figure"], a["busy"], a["suggest_num_ps"]) for a in alerts] == [("ps_overloaded", 0.54, 0.58, 3)]
    assert "the workers wait on PS 0 (rank 0, host h) 54% of their step" in alerts[0]["message"]
    _set(rows, 0, busy=0.2, apply=0.2)
    assert judge(rows, host_records(rows, host_of, names, ps_ranks), host_of, names, ps_ranks, MON, {}, []) == []


@pytest.mark.parametrize("key,value,msg", [("metrics.every", "-1", "must be seconds >= 0"),
                                           ("monitor.memory", "1.5", "must be a share in (0, 1]"),
                                           ("monitor.on_alert", "stop", "must be log, checkpoint_and_stop or rebalance")])
def test_monitor_settings_are_checked(key, value, msg):
    from hpcps.config import load_config
    with pytest.raises(ValueError, match=f"{key}.*{msg}".replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        load_config(None, [f"{key}={value}"], environ={})


def test_a_rate_alert_is_raised_only_when_two_judgments_in_a_row_find_it():
    """A PS overload or a straggler in one sample window alone (a checkpoint, a descheduled rank on
    a loaded node) is no alert, and does not stop a job; found again by the next judgment it is
    raised, once. A memory alert is raised at once."""
    from hpcps.monitor.monitor import Monitor
    m = object.__new__(Monitor)
    stops = []
    m.active, m.raised, m.pending, m.post, m.log = set(), [], set(), {}, None
    m.mon, m.on_alert = types.SimpleNamespace(on_alert="checkpoint_and_stop"), stops.append
    ps = {"rule": "ps_overloaded", "rank": 0, "message": "PS overloaded"}
    mem = {"rule": "memory", "rank": 1, "message": "memory"}
    m._raise(10, [ps, mem])
    assert [a["alert"] for a in m.raised] == ["memory"] and stops == [mem]
    m._raise(20, [])                                # the overload cleared: it starts over
    m._raise(30, [ps])
    assert [a["alert"] for a in m.raised] == ["memory"]
    m._raise(40, [ps])
    m._raise(50, [ps])
    assert [(a["alert"], a["step"]) for a in m.raised] == [("memory", 10), ("ps_overloaded", 40)] and stops == [mem, ps]
