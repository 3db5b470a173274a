"""Every example and benchmark runs under mpiexec at small size."""

import json
import os

import pytest

from mpirun import ROOT, run_mpi


def test_example_sparse_basics():
    """Under the README's -n 4 (3 workers: the third's ids wrap around the table)."""
    r = run_mpi(4, [ROOT / "examples" / "sparse_basics.py"])
    assert r.stdout.count("row 7 moved by -0.100, row 8 by -0.100") == 3
    assert r.stdout.count("users 0 and 1 moved by -0.100, -0.100; items 500 by -0.300") == 3   # push_many
    assert r.stdout.count("rejected as expected: table 'items': id 100000 out of range") == 3


def test_bench_sparse_smoke(tmp_path):
    out = tmp_path / "bench.json"
    r = run_mpi(3, [ROOT / "scripts" / "bench_sparse.py", "--rows", "20000", "--dim", "16", "--batch", "256",
                    "--iters", "5", "--out", out], timeout=180)
    report = json.loads(out.read_text())
    rates = report["per_worker_mrows_per_s"]
    for key in ("local_gather", "local_index_add", "two_sided_pull", "hpcps_auto_pull", "hpcps_auto_push",
                "hpcps_rma_pull", "hpcps_rma_push", "hpcps_rma_get_pull"):
        assert rates[key] > 0, key
    assert set(report["ratios"]) >= {"pull_vs_local_gather", "pull_vs_two_sided", "push_vs_local_index_add"}
    for key in ("dynamic_pull_vs_fixed", "dynamic_sync_step_vs_fixed", "dynamic_push_in_step_vs_fixed"):
        assert 0 < report["ratios"][key] < 100, (key, report["ratios"])
    assert report["config"]["num_workers"] == 2
    assert report["memory"]["worker_window_bytes"] == 0
    assert report["memory"]["ps_table_bytes"] == 20000 * 16 * 4 + 8
    assert "pull_vs_local_gather" in r.stdout


def test_shell_scripts_parse():
    import subprocess
    for script in ("scripts/run", "scripts/gpu_check.sh", ".ci/run", "slurm/demo.sbatch", "slurm/train.sbatch",
                   "slurm/chain.sh", "slurm/tune.sbatch", "scripts/slurm_local.sh"):
        subprocess.run(["bash", "-n", str(ROOT / script)], check=True)


def test_bench_checkpoint_smoke(tmp_path):
    import subprocess
    import sys
    out = tmp_path / "b.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_checkpoint.py"), "--dir", str(tmp_path / "d"),
                    "--rows", "5000", "--steps", "20", "--out", str(out), "--part", "pfs", "--ranks", "3"], check=True,
                   capture_output=True, timeout=600, env=__import__("mpirun").mpi_env())
    r = json.loads(out.read_text())
    assert r["checkpoint_bytes"] > 0 and r["write_bandwidth_mb_s"] > 0 and r["dd_bandwidth_mb_s"] > 0
    assert r["full_bytes"] > r["incremental_bytes"] > 0 and r["restore_s"] > 0
    assert r["dd_under_training_load"] is True and len(r["dd_each_mb_s"]["under_load"]) == 4
    assert r["writer_alone_vs_dd"] > 0 and len(r["writer_alone_mb_s"]) == 4


def test_bench_checkpoint_levels_smoke(tmp_path):
    import subprocess
    import sys
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_checkpoint.py"), "--dir", str(tmp_path / "d"),
                        "--part", "levels", "--rounds", "1", "--level-steps", "20", "--workloads", "main", "--ranks", "3",
                        "--restores", "1", "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env=__import__("mpirun").mpi_env())
    assert r.returncode == 0, r.stderr[-3000:]
    main = json.loads(out.read_text())["levels"]["main"]
    assert set(main["levels"]) == {"local", "pfs"} and main["runs"]["local"][0]["checkpoints"] == 1
    assert main["restore_s"]["local"] > 0 and len(main["restore_pfs_vs_local"]) == 1
    # a restart from each level (its own final checkpoint removed after it)
    assert all(len(v) == 1 and min(v) > 0 for v in main["restore_runs_s"].values()), main["restore_runs_s"]
    assert "main local:" in r.stdout and "main restore (median of 1):" in r.stdout


def test_fault_checkpoint_script_smoke(tmp_path):
    import subprocess
    import sys
    out = tmp_path / "f.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "fault_checkpoint.py"), "--trials", "1",
                    "--dir", str(tmp_path / "d"), "--out", str(out)], check=True, capture_output=True,
                   timeout=600, env=__import__("mpirun").mpi_env())
    r = json.loads(out.read_text())
    assert r["trials"] == 1 and r["corrupt_committed"] == 0 and r["restart_failures"] == 0


def test_stress_stop_requests_at_random_moments_keep_ranks_in_step(tmp_path):
    """A run of scripts/stress_stop.py (50 of them are the benchmark-style run): a stop request of a
    random kind at a random moment with a CPU hog beside the job, then the restart; zero mismatches."""
    import subprocess
    import sys
    out = tmp_path / "s.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "stress_stop.py"), "--runs", "1", "--hogs", "1",
                        "--steps", "150", "--seed", "7", "--dir", str(tmp_path / "d"), "--out", str(out)],
                       capture_output=True, text=True, timeout=900, env=__import__("mpirun").mpi_env())
    res = json.loads(out.read_text())
    assert r.returncode == 0 and res["runs"] == 1 and res["mismatches"] == 0, r.stdout + r.stderr


def test_bench_e2e_smoke(tmp_path):
    import subprocess
    import sys
    out = tmp_path / "e2e.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_e2e.py"), "--steps", "8", "--warmup", "2",
                    "--ranks", "3", "--out", str(out)], check=True, capture_output=True, timeout=900,
                   env=__import__("mpirun").mpi_env())
    r = json.loads(out.read_text())
    assert r["config"]["repeat"] == 1
    for k in ("hpcps", "hpcps_pipeline_on", "hpcps_no_prefetch", "torch_rpc", "single_process"):
        res = r["results"][k]
        assert res["samples_per_s"] > 0 and res["steps"] == 6 and res["runs_samples_per_s"] == [res["samples_per_s"]]
    assert r["hpcps_vs_torch_rpc"] > 0 and r["hpcps_per_core_vs_single_process"] > 0
    assert r["pipeline_on_vs_off"] > 0 and r["results"]["hpcps_no_prefetch"]["same_run_as"] == "hpcps"   # ctr.toml: off
    assert r["targets"] == {"hpcps_vs_torch_rpc": 2.0, "hpcps_per_core_vs_single_process": 0.8}
    assert r["config"]["oversubscribed"] == (r["config"]["ranks"] > r["config"]["cpus"])


def test_bench_sparse_grid_smoke(tmp_path):
    import subprocess
    import sys
    out = tmp_path / "grid.json"
    subprocess.run([sys.executable, "-m", "hpcps", "bench", "sparse_grid", "--rows", "20000", "--batches",
                    "512", "--dims", "16", "--num-ps", "1", "2", "--rows-per-point", "4096", "--out", str(out)],
                   check=True, capture_output=True, timeout=600, env=__import__("mpirun").mpi_env())
    r = json.loads(out.read_text())
    assert [(p["num_ps"], p["dim"], p["batch"]) for p in r["points"]] == [(1, 16, 512), (2, 16, 512)]
    assert all(p["pull_mrows_per_s"] > 0 and p["pull_vs_local_gather"] > 0 for p in r["points"])


def test_bench_scaling_smoke(tmp_path):
    import subprocess
    import sys
    out = tmp_path / "scaling.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_scaling.py"), "--config",
                    str(ROOT / "tests" / "configs" / "tiny_ctr.toml"), "--steps", "12", "--warmup", "4",
                    "--layouts", "1+1,2+2", "--out", str(out)], check=True, capture_output=True, timeout=600,
                   env=__import__("mpirun").mpi_env())
    r = json.loads(out.read_text())
    assert [(p["num_ps"], p["workers"]) for p in r["points"]] == [(1, 1), (2, 2)]
    assert r["points"][0]["efficiency_per_core"] == 1.0 and all(p["samples_per_s"] > 0 for p in r["points"])


def test_bench_dtype_smoke(tmp_path):
    import subprocess
    import sys
    out = tmp_path / "dt.json"
    subprocess.run([sys.executable, "-m", "hpcps", "bench", "dtype", "--steps", "40", "--ranks", "3",
                    "--transport", "rma", "--variants", "float32,both_fp16",
                    "--config", str(ROOT / "tests" / "configs" / "tiny_ctr.toml"), "--out", str(out)],
                   check=True, capture_output=True, timeout=600, env=__import__("mpirun").mpi_env())
    r = json.loads(out.read_text())["results"]
    assert set(r) == {"float32", "both_fp16"} and all(0 < v["auc"] <= 1 for v in r.values())
    assert (r["both_fp16"]["pull_dtype"], r["both_fp16"]["push_dtype"]) == ("float16", "float16")
    assert r["both_fp16"]["push_mailbox_full"] == 0               # over RMA every push went through the mailbox:
    assert abs(r["both_fp16"]["bytes_vs_float32"] - 0.5) < 1e-9  # half the bytes both ways


@pytest.mark.skipif(os.geteuid() != 0, reason="pretend hosts need root (network namespaces)")
def test_bench_hosts_smoke(tmp_path):
    import subprocess
    import sys
    out = tmp_path / "hosts.json"
    # across_shared (across's path on shared CPUs) and one_host_dynamic left out: a smoke test
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_hosts.py"), "--steps", "20", "--warmup", "10",
                        "--dynamic", "--only", "one_host,across,rpc_across,across_dynamic",
                        "--out", str(out)], capture_output=True, text=True, timeout=900,
                       env=__import__("mpirun").mpi_env())
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    for k in ("one_host", "across", "rpc_across", "across_dynamic"):
        assert res[k]["samples_per_s"] > 0, k
    assert res["across"]["layout"]["ps_per_host"] == [0, 1] and res["one_host"]["layout"]["hosts"] == 1
    assert res["across_dynamic"]["layout"]["ps_per_host"] == [0, 1]
    assert set(res["ratios"]) == {"across_vs_one_host", "across_vs_rpc_across", "push_vs_pull_across",
                                  "across_dynamic_vs_fixed"}
    assert res["ping_pong"]["bandwidth_mb_s"] > 0 and "across_vs_rpc_across" in r.stdout
    assert not [n for n in os.listdir("/run/netns") if n.startswith("bh-")]      # its hosts are gone


def test_bench_mpis_smoke(tmp_path):
    """bench_sparse on MPICH and on Open MPI in one run (Open MPI's wheel set up by scripts/run if needed);
    each ratio compared across them."""
    import subprocess
    import sys
    out = tmp_path / "mpis.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_mpis.py"), "--only", "sparse", "--rounds", "1",
                        "--sparse-args", "--rows 20000 --dim 16 --batch 256 --iters 5", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=__import__("mpirun").mpi_env())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["mpis"]["mpich"]["library"] == "MPICH" and res["mpis"]["openmpi"]["library"] == "Open MPI"
    row = res["ratios"]["sparse.pull_vs_local_gather"]
    assert row["mpich"] > 0 and row["openmpi"] > 0 and row["openmpi_vs_mpich"] > 0
    assert res["reports"]["sparse"]["openmpi"][0]["mpi"]["windows"] == "shared"
    assert "openmpi vs mpich" in r.stdout


def _have_torchrec() -> bool:
    import importlib.util
    return importlib.util.find_spec("torchrec") is not None and importlib.util.find_spec("fbgemm_gpu") is not None


@pytest.mark.skipif(not _have_torchrec(), reason="TorchRec is optional: scripts/run setup --peers (the test command installs it)")
def test_bench_peers_smoke_trains_the_same_model_as_torchrec(tmp_path):
    """bench_peers.py on the main job, 2 ranks, table-wise: both train the same model from the same
    rows on the same samples, so their AUCs agree to 0.003 (measured: 0.0001)."""
    import subprocess
    import sys
    out = tmp_path / "peers.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_peers.py"), "--workloads", "main", "--ranks", "2",
                        "--steps", "40", "--warmup", "10", "--shardings", "table_wise", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=__import__("mpirun").mpi_env())
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    case = json.loads(out.read_text())["cases"]["main_2"]
    assert case["best_torchrec"] == "torchrec_table_wise" and case["torchrec_table_wise"]["samples_per_s"] > 0
    assert abs(case["auc_hpcps_minus_best"]) < 0.003 and case["hpcps"]["auc"] > 0.7, case
    assert "target >= 1.5" in r.stdout


def test_bench_quality_smoke_scores_each_model_once_on_rows_it_never_saw(tmp_path):
    import subprocess
    import sys
    out = tmp_path / "q.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_quality.py"), "--data",
                        f"criteo=examples/criteo.toml:{ROOT / 'tests' / 'data' / 'criteo_head1000.txt'};"
                        "data.hash_rows=2000;job.max_epochs=2", "--folds", "1", "--kinds", "", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())["data"]["criteo"]
    assert got["train_lines"] == 800 and got["test_lines"] == 200
    test = got["test"]
    assert 0.5 < test["baseline"]["auc"] < 1 and 0.5 < test["shipped"]["auc"] < 1
    # scored by hpcps evaluate on the test rows, not the early-stopping rows it chose its model on
    assert test["shipped"]["auc"] != test["shipped"]["valid_auc"] and test["shipped"]["steps"] >= test["shipped"]["best_step"]
