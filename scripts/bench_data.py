"""The data reader: parse speed against its limits, worker memory against the input's size, and the
reader's rate against training's, on Criteo-format files (scripts/make_ctr_files.py) made here.

    .venv/bin/python scripts/bench_data.py [--sizes 6,50,500,600,2000] [--steps 400] [--keep DIR]
                                           [--out results/bench_data.json]

1. Parse, one process, one thread, on the plain half of the largest input of at most 600 MB:
     hpcps_stream   the streamed reader (hpcps.data.stream) over an epoch, one worker, default
                    windows: samples/s and MB/s of text
     count_lines    the limit of reading the file and counting its lines (no parsing)
     gunzip_count   the same for the gzipped copy: decompressing and counting
     pandas         pandas.read_csv(sep="\\t", header=None) of the whole file
2. Training, `hpcps train` under mpiexec (1 PS + 2 workers, examples/criteo.toml's model, global
   batches of 1024, --steps steps, data.reader = stream) on each size in --sizes (MB of text, each
   in two parts, the second gzipped, given as a glob): training samples/s, every rank's peak RSS,
   the ratio of the largest input's worker RSS to the smallest's (target: within 1.1x, and at most
   800 MB on ~600 MB), and the reader's rate per core against training's rate per worker
   (target: >= 2x).
3. The same training with data.reader = memory (every worker parses the whole input) on the sizes
   up to --memory-max: what streaming saves.
"""

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mpirun import run_mpi  # noqa: E402

ROW_BYTES = 246          # mean bytes of a make_ctr_files.py criteo line


def make_input(tmp: Path, mb: int) -> Path:
    """Two parts of ``mb`` MB of text in all, the second gzipped: ``tmp/in<mb>/day_*``."""
    out = tmp / f"in{mb}"
    if not out.exists():
        rows = int(mb * 1e6 / ROW_BYTES)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_ctr_files.py"), "criteo", "--rows", str(rows),
                        "--parts", "2", "--out", str(out)], check=True, capture_output=True)
        with open(out / "day_1", "rb") as f, gzip.open(out / "day_1.gz", "wb", compresslevel=3) as g:
            while chunk := f.read(1 << 24):
                g.write(chunk)
        (out / "day_1").unlink()
    return out


def bench_parse(tmp: Path, mb: int) -> dict:
    plain = make_input(tmp, mb) / "day_0"
    size = plain.stat().st_size
    res = {"file_mb": round(size / 1e6, 1)}
    t = time.perf_counter()
    lines = 0
    with open(plain, "rb") as f:
        while chunk := f.read(1 << 24):
            lines += chunk.count(b"\n")
    res["count_lines_mb_s"] = round(size / 1e6 / (time.perf_counter() - t), 1)
    gz = tmp / "day_0.gz"
    if not gz.exists():
        with open(plain, "rb") as f, gzip.open(gz, "wb", compresslevel=3) as g:
            g.write(f.read())
    t = time.perf_counter()
    with gzip.open(gz, "rb") as f:
        while chunk := f.read(1 << 24):
            chunk.count(b"\n")
    res["gunzip_count_mb_s"] = round(size / 1e6 / (time.perf_counter() - t), 1)
    import pyarrow.csv  # noqa: F401 - imported before the clock starts, as in a training run
    from hpcps.config import load_config
    from hpcps.data import make_data
    cfg = load_config(None, ["data.format=criteo", f"data.path={plain}", "data.batch_size=1024", "job.epochs=1",
                             "data.reader=stream", "data.eval_fraction=0"], environ={})
    data = make_data(cfg.data, 0, 1, 0)
    t = time.perf_counter()
    for s in range(data.steps_per_epoch):
        data.train_batch(s)
    dt = time.perf_counter() - t
    n = data.steps_per_epoch * 1024
    res.update(hpcps_stream_samples_s=round(n / dt), hpcps_stream_mb_s=round(n * size / lines / 1e6 / dt, 1))
    import pandas as pd
    t = time.perf_counter()
    pd.read_csv(plain, sep="\t", header=None)
    dt = time.perf_counter() - t
    res.update(pandas_samples_s=round(lines / dt), pandas_mb_s=round(size / 1e6 / dt, 1))
    res["ratio_hpcps_vs_pandas"] = round(res["hpcps_stream_samples_s"] / res["pandas_samples_s"], 2)
    res["ratio_hpcps_vs_count_lines"] = round(res["hpcps_stream_mb_s"] / res["count_lines_mb_s"], 3)
    return res


def bench_train(tmp: Path, mb: int, steps: int, reader: str = "stream") -> dict:
    src = make_input(tmp, mb)
    argv = ["-m", "hpcps", "train", "--config", str(ROOT / "examples" / "criteo.toml"), "--set",
            f"data.path={src}/day_*", f"data.reader={reader}", "data.batch_size=1024", "data.hash_rows=100000",
            "data.eval_fraction=0.001", f"job.steps={steps}", "job.epochs=0", "job.eval_each_epoch=false",
            "metrics.progress=false", "metrics.path=", "job.log_every=1000"]
    t = time.perf_counter()
    r = run_mpi(3, argv, timeout=3600)
    wall = time.perf_counter() - t
    final = [json.loads(x) for x in r.stdout.splitlines() if x.startswith('{"final"')][-1]["final"]
    mem = final["memory"]
    return {"input_mb": mb, "reader": reader, "samples_per_s": round(final["samples_per_s"]), "wall_s": round(wall, 1),
            "worker_peak_rss_mb": mem["worker_peak_rss_mb"], "ps_peak_rss_mb": mem["ps_peak_rss_mb"],
            "train_samples": final["data"]["train_samples"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="6,50,500,600,2000", help="input sizes in MB of text (default 6,50,500,600,2000)")
    ap.add_argument("--steps", type=int, default=400, help="training steps per size (default 400)")
    ap.add_argument("--memory-max", type=int, default=600,
                    help="also train with data.reader = memory on the sizes up to this (default 600)")
    ap.add_argument("--keep", default="", help="a directory for the generated inputs (kept between runs)")
    ap.add_argument("--out", default="results/bench_data.json")
    a = ap.parse_args(argv)
    tmp = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="hpcps-bench-data-"))
    tmp.mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in a.sizes.split(",")]
    res = {"parse": bench_parse(tmp, max([s for s in sizes if s <= 600] or [50]))}
    p = res["parse"]
    print(f"parse ({p['file_mb']} MB plain): hpcps stream {p['hpcps_stream_samples_s']:,} samples/s "
          f"({p['hpcps_stream_mb_s']} MB/s); pandas.read_csv {p['pandas_samples_s']:,} samples/s "
          f"({p['pandas_mb_s']} MB/s): {p['ratio_hpcps_vs_pandas']}x; limits: count lines "
          f"{p['count_lines_mb_s']} MB/s, gunzip+count {p['gunzip_count_mb_s']} MB/s")
    res["train"] = []
    for mb in sizes:
        t = bench_train(tmp, mb, a.steps)
        res["train"].append(t)
        print(f"train on {mb} MB: {t['samples_per_s']:,} samples/s, worker peak RSS {t['worker_peak_rss_mb']} MB, "
              f"PS {t['ps_peak_rss_mb']} MB ({t['wall_s']} s with the counting pass)")
    res["memory_reader"] = []
    for mb in [s for s in sizes if s <= a.memory_max]:
        t = bench_train(tmp, mb, a.steps, "memory")
        res["memory_reader"].append(t)
        print(f"train on {mb} MB read into memory: {t['samples_per_s']:,} samples/s, worker peak RSS "
              f"{t['worker_peak_rss_mb']} MB ({t['wall_s']} s with reading)")
    rss = [max(t["worker_peak_rss_mb"]) for t in res["train"]]
    res["rss_ratio_largest_vs_smallest"] = round(rss[-1] / rss[0], 3)
    per_worker = max(t["samples_per_s"] for t in res["train"]) / 2
    res["reader_vs_training_per_worker"] = round(p["hpcps_stream_samples_s"] / per_worker, 2)
    print(f"worker peak RSS, largest input vs smallest: {res['rss_ratio_largest_vs_smallest']}x (target <= 1.1x); "
          f"reader per core vs training per worker: {res['reader_vs_training_per_worker']}x (target >= 2x)")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
