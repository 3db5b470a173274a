"""Where ``hpcps predict`` writes. ``--out`` ending in ``.csv`` or ``.parquet`` is one file; any other
path is a directory of parts in input order (``part-00000.csv`` ...) with ``plan.json`` (written
first) and ``index.json`` (written last: the parts, their input lines and rows). Workers write
parts (a one-file output's go to a hidden ``.NAME.parts`` beside it, which worker 0 joins in order
at the end). A part is written under a temporary name and renamed, so a part file that exists is
whole: a rerun of a killed predict with the same checkpoint, inputs and options writes only the
missing parts. Local, pure (no MPI).
"""

import json
import os
import shutil
from pathlib import Path

import numpy as np

from ..checkpoint.lock import DirLock

__all__ = ["Output", "FORMATS"]

FORMATS = ("csv", "parquet")
PLAN, INDEX = "plan.json", "index.json"


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


class Output:
    """The output of one predict: ``out`` (a file or a directory, by its name), ``fmt`` (csv or
    parquet; default from a file's suffix, else csv), ``overwrite``."""

    def __init__(self, out, fmt: str = "", overwrite: bool = False):
        self.out, self.overwrite = Path(out), overwrite
        suffix = self.out.suffix.lower()                   # NAME.CSV is a file as NAME.csv is
        self.single = suffix in (".csv", ".parquet") and not str(out).endswith("/")
        self.fmt = fmt or (suffix[1:] if self.single else "csv")
        if self.fmt not in FORMATS:
            raise ValueError(f"--format {fmt}: must be csv or parquet")
        if self.single and suffix[1:] != self.fmt:
            raise ValueError(f"--out {out} with --format {fmt}: the name says {suffix[1:]}")
        self.parts_dir = self.out.parent / f".{self.out.name}.parts" if self.single else self.out
        self.plan = None
        # one predict at a time writes an output: a second one is refused, naming the first
        self.lock = DirLock(path=self.out.parent / f".{self.out.name}.lock", what=f"--out {self.out}")

    def check(self, checkpoint: Path, inputs=()) -> None:
        """Before any communication (every rank alike): ``ValueError`` when the output would go
        inside the checkpoint's directory, would replace or hold one of the ``inputs`` (even with
        ``--overwrite``), or exists and is not this kind of unfinished predict output (unless
        ``--overwrite``). Local."""
        if _inside(self.out, checkpoint.parent):
            raise ValueError(f"--out {self.out}: inside the checkpoint directory {checkpoint.parent}: "
                             "write predictions elsewhere")
        for f in map(Path, inputs):
            if f.resolve() == self.out.resolve() or _inside(f, self.out):
                raise ValueError(f"--out {self.out}: {'is' if f.resolve() == self.out.resolve() else 'holds'} "
                                 f"the input {f}: write predictions elsewhere (--overwrite never replaces input)")
        if not self.out.parent.is_dir():
            raise ValueError(f"--out {self.out}: the directory {self.out.parent} does not exist")
        holder = self.lock.holder()
        if holder is not None:
            raise ValueError(f"--out {self.out}: another predict writes it (host {holder.get('host')}, process "
                             f"{holder.get('pid')}; {self.lock.path}): wait for it, or write elsewhere")
        if self.single and self.out.is_dir():
            raise ValueError(f"--out {self.out}: a directory, but the name asks for one file")
        if self.single and self.out.exists() and not self.overwrite:
            raise ValueError(f"--out {self.out}: exists (use --overwrite to replace it)")
        if not self.single and self.out.exists():
            if not self.out.is_dir():
                raise ValueError(f"--out {self.out}: a file, but the name (no .csv or .parquet) asks for a directory")
            ours = (self.out / PLAN).exists()
            if any(self.out.iterdir()) and not ours:
                raise ValueError(f"--out {self.out}: a directory that is not a predict output: not written to")
            if ours and (self.out / INDEX).exists() and not self.overwrite:
                raise ValueError(f"--out {self.out}: holds a finished predict (use --overwrite to replace it)")

    def begin(self, plan: dict, lead: bool) -> None:
        """Every worker, before any part: an unfinished output of another plan (checkpoint, inputs,
        parts, format) is a ``ValueError`` unless overwriting; worker 0 (``lead``) then makes the
        parts' directory and writes the plan. Local (worker 0 writes; the caller then waits for it)."""
        self.plan = plan
        old = self.parts_dir / PLAN
        if not self.overwrite and self.plan_differs(old):
            raise ValueError(f"--out {self.out}: holds the unfinished parts of another predict (another "
                             "checkpoint, input or option): use --overwrite or another --out")
        if not lead:
            return
        self.lock.acquire()                 # released by finish; a killed predict's is stale
        if self.overwrite and self.parts_dir.exists():
            shutil.rmtree(self.parts_dir)
        self.parts_dir.mkdir(exist_ok=True)
        if not old.exists():
            _write_atomic(old, json.dumps(plan, indent=1).encode())

    def plan_differs(self, path: Path) -> bool:
        return path.exists() and json.loads(path.read_text()) != self.plan

    def part_path(self, i: int) -> Path:
        return self.parts_dir / f"part-{i:05d}.{self.fmt}"

    def done(self, i: int) -> bool:
        """Whether part ``i`` was written whole by an earlier run. Local."""
        return self.part_path(i).exists()

    def write(self, i: int, columns: dict) -> int:
        """Part ``i``'s rows (``columns``: name -> numpy or pyarrow array or list, in order), atomically; returns the
        rows. Local."""
        import pyarrow as pa
        table = pa.table({k: v if isinstance(v, (pa.Array, pa.ChunkedArray)) else pa.array(v) for k, v in columns.items()})
        path = self.part_path(i)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        if self.fmt == "parquet":
            import pyarrow.parquet as pq
            pq.write_table(table, tmp)
        else:
            import pyarrow.csv as pacsv
            try:                                                  # pyarrow >= 16: no quotes on the header
                options = pacsv.WriteOptions(quoting_header="none")
            except TypeError:
                options = pacsv.WriteOptions()
            pacsv.write_csv(table, tmp, options)
        os.replace(tmp, path)
        self.lock.refresh()                 # worker 0's, each part: the lock stays alive while it writes
        return table.num_rows

    def rows(self, i: int) -> int:
        """The rows of part ``i`` as written. Local."""
        path = self.part_path(i)
        if self.fmt == "parquet":
            import pyarrow.parquet as pq
            return pq.ParquetFile(path).metadata.num_rows
        with open(path, "rb") as f:
            return sum(1 for _ in f) - 1

    def finish(self, rows: list, lines: list, summary: dict) -> None:
        """Worker 0, after every part: a directory's ``index.json``, or the parts joined in order
        into the one file (then the parts go). Local."""
        if not self.single:
            parts = [{"file": self.part_path(i).name, "lines": list(lines[i]), "rows": int(rows[i])}
                     for i in range(len(rows))]
            index = {**self.plan, **summary, "parts": parts, "rows": int(np.sum(rows))}
            _write_atomic(self.out / INDEX, json.dumps(index, indent=1).encode())
            self.lock.release()
            return
        tmp = self.out.with_name(f".{self.out.name}.tmp{os.getpid()}")
        if self.fmt == "parquet":
            import pyarrow.parquet as pq
            writer = None
            for i in range(len(rows)):
                t = pq.read_table(self.part_path(i))
                writer = writer or pq.ParquetWriter(tmp, t.schema)
                writer.write_table(t)
            writer.close()
        else:
            with open(tmp, "wb") as f:
                for i in range(len(rows)):
                    with open(self.part_path(i), "rb") as part:
                        head = part.readline()
                        if i == 0:
                            f.write(head)
                        shutil.copyfileobj(part, f, 1 << 20)
        os.replace(tmp, self.out)
        shutil.rmtree(self.parts_dir)
        self.lock.release()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
