"""One trial of a search: ``hpcps train`` as an MPI job of its own, watched while it runs. Local
(the tuning process; the trial's ranks are another job).

Its evaluations are read from its metrics file as they are written and reported to Optuna; a trial
the pruner stops is ended (its whole process group) at once. The trial's value is the final
line's metric: the best evaluation's model, which the run restores at its end (``job.restore_best``).
"""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["TrialRun", "launcher_argv", "Pruned"]

HEARTBEAT_S = 20.0           # how often a running trial says it is alive (user attribute "alive")


class Pruned(Exception):
    """The pruner stopped the trial after the evaluation at ``step``."""

    def __init__(self, step: int):
        super().__init__(f"pruned after step {step}")
        self.step = step


def launcher_argv(launcher: str, ranks: int) -> list[str]:
    """The command that starts a trial's ``ranks`` ranks: ``launcher`` with ``{ranks}`` replaced,
    or the mpiexec beside this python (a venv's), else on ``PATH``, with ``-n ranks``. Local."""
    if launcher:
        return shlex.split(launcher.replace("{ranks}", str(ranks)))
    here = Path(sys.executable).parent / "mpiexec"
    exe = str(here) if here.exists() else shutil.which("mpiexec")
    if exe is None:
        raise ValueError("hpcps tune: no mpiexec beside python nor on PATH: set tune.launcher (e.g. \"srun -n {ranks}\")")
    return [exe, "-n", str(ranks)]


class TrialRun:
    """Run ``hpcps train --config config --set sets...`` for a trial in ``folder`` (its log,
    metrics and checkpoints; the checkpoints are removed after it). ``report(value, n)`` (its n-th
    evaluation) and ``prune()`` are the Optuna trial's (None: no pruning); ``alive()`` is called every
    :data:`HEARTBEAT_S` while it runs."""

    def __init__(self, folder: Path, config: str | None, sets: list[str], metric: str, argv0: list[str]):
        self.folder, self.config, self.sets, self.metric, self.argv0 = Path(folder), config, sets, metric, argv0
        self.metrics = self.folder / "metrics.jsonl"
        self.log = self.folder / "train.log"

    def command(self) -> list[str]:
        """The trial's whole command line. Local."""
        own = [f"metrics.path={self.metrics}", f"checkpoint.dir={self.folder / 'checkpoints'}",
               "metrics.progress=false", "job.export=", "job.export_best=false", "checkpoint.keep=1"]
        cfg = ["--config", self.config] if self.config else []
        return [*self.argv0, sys.executable, "-m", "mpi4py", "-m", "hpcps", "train", *cfg, "--set", *self.sets, *own]

    def _evaluations(self, seen: int) -> tuple[list, int]:
        """The eval records written since byte ``seen``: ``([(step, value)], new offset)``."""
        if not self.metrics.exists():
            return [], seen
        with open(self.metrics, "rb") as f:
            f.seek(seen)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1                     # a line still being written waits
        out = []
        for line in chunk[:end].splitlines():
            rec = json.loads(line)
            if "eval" in rec and self.metric in rec["eval"]:
                out.append((int(rec["step"]), float(rec["eval"][self.metric])))
        return out, seen + end

    def run(self, report=None, prune=None, alive=None, timeout: float = 0) -> dict:
        """Run the trial to its end; returns its final line. Raises :class:`Pruned`, or
        ``RuntimeError`` with the log's tail when the job fails. Local."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.metrics.unlink(missing_ok=True)
        with open(self.log, "w") as log:
            log.write(" ".join(shlex.quote(a) for a in self.command()) + "\n")
            log.flush()
            proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=_die_with_parent)
        seen, beat, started, count = 0, time.monotonic(), time.monotonic(), 0
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                evals, seen = self._evaluations(seen)
                for step, value in evals:
                    count += 1
                    if report is not None:            # by the evaluation's number: trials of other batch sizes compare
                        report(value, count)
                    if prune is not None and prune():
                        raise Pruned(step)
                if alive is not None and time.monotonic() - beat >= HEARTBEAT_S:
                    alive()
                    beat = time.monotonic()
                if timeout and time.monotonic() - started > timeout:
                    raise RuntimeError(f"trial in {self.folder}: still running after {timeout:g} s")
        finally:
            if proc.poll() is None:
                _end(proc)
            shutil.rmtree(self.folder / "checkpoints", ignore_errors=True)
        text = self.log.read_text(errors="replace")
        # the final JSON line; another rank's stderr may have landed before it on the same line of the log
        finals = [line[line.index('{"final"'):] for line in text.splitlines() if '{"final"' in line]
        if proc.returncode != 0 or not finals:
            raise RuntimeError(f"trial in {self.folder}: hpcps train exited {proc.returncode}:\n"
                               + "\n".join(text.splitlines()[-15:]))
        return json.loads(finals[-1])["final"]


def _die_with_parent() -> None:
    """In the trial's launcher, before exec: Linux sends it SIGKILL when the search dies (kill -9
    included), so no trial runs on unwatched; elsewhere nothing."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG


def _end(proc) -> None:
    """End the trial's launcher and every rank (its process group): TERM, then KILL."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
