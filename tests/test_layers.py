"""The layers of hpcps (docs/design.md, "Layers"): each module imports only from its own layer or
below, read from the source with ``ast``; and the pure modules start no MPI."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "hpcps"

# module (prefix) -> hpcps modules (prefixes) it may import; the first matching prefix decides
LAYERS = [
    ("hpcps._version", []),
    ("hpcps.core", ["hpcps.core"]),
    ("hpcps.runtime.stopping", []),
    ("hpcps.runtime.topology", ["hpcps.core"]),
    ("hpcps.sparse", ["hpcps.sparse", "hpcps.core"]),
    ("hpcps.dense", ["hpcps.dense", "hpcps.core"]),
    ("hpcps.runtime.context", ["hpcps.runtime.topology", "hpcps.sparse", "hpcps.core"]),
    ("hpcps.runtime", []),
    ("hpcps.optim", ["hpcps.core"]),                 # the public name of the sparse optimizers
    ("hpcps.models", ["hpcps.models"]),
    ("hpcps.nn", ["hpcps.nn", "hpcps.sparse", "hpcps.core"]),
    ("hpcps.data", ["hpcps.data", "hpcps.core"]),
    ("hpcps.config", ["hpcps.config", "hpcps.core"]),
    ("hpcps.monitor", ["hpcps.monitor", "hpcps.core"]),
    ("hpcps.checkpoint", ["hpcps.checkpoint", "hpcps.core", "hpcps._version"]),
    ("hpcps.train", ["hpcps.train", "hpcps.monitor", "hpcps.runtime", "hpcps.sparse", "hpcps.dense", "hpcps.nn",
                     "hpcps.models", "hpcps.data", "hpcps.checkpoint", "hpcps.config", "hpcps.core"]),
    ("hpcps.predict", ["hpcps.predict", "hpcps.train", "hpcps.runtime.context", "hpcps.nn", "hpcps.data",
                       "hpcps.checkpoint", "hpcps.config", "hpcps.core"]),
    ("hpcps.plan", ["hpcps.plan", "hpcps.train", "hpcps.config", "hpcps.data", "hpcps.core"]),
    ("hpcps.tune", ["hpcps.tune", "hpcps.config", "hpcps.data"]),
    ("hpcps.tools.reference", ["hpcps.train", "hpcps.config", "hpcps.data", "hpcps.models", "hpcps.core"]),
    ("hpcps.tools.demo", ["hpcps.runtime.context", "hpcps.sparse", "hpcps.core"]),
    ("hpcps.tools.report", ["hpcps.core.metrics", "hpcps.monitor.plots"]),
    ("hpcps.tools.baseline", ["hpcps.data", "hpcps.core"]),
    ("hpcps.tools", []),
    ("hpcps.cli", ["hpcps"]),
    ("hpcps.__main__", ["hpcps.cli", "hpcps.runtime.stopping"]),
    ("hpcps", ["hpcps._version", "hpcps.core.errors"]),      # the face: the rest is loaded lazily by name
]
PURE = ["hpcps", "hpcps.config", "hpcps.core.ids", "hpcps.core.sharding", "hpcps.core.optimizers",
        "hpcps.core.settings", "hpcps.core.layout", "hpcps.core.wait", "hpcps.core.malloc", "hpcps.core.process",
        "hpcps.core.inputs", "hpcps.core.hashindex", "hpcps.core.dynshard", "hpcps.core.torchlib",
        "hpcps.core.metrics", "hpcps.core.errors", "hpcps.runtime", "hpcps.runtime.stopping", "hpcps.tools",
        "hpcps.data", "hpcps.models", "hpcps.optim", "hpcps.tools.baseline", "hpcps.tune",
        "hpcps.monitor", "hpcps.monitor.probe", "hpcps.monitor.fields", "hpcps.monitor.rules", "hpcps.monitor.plots"]


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        yield ".".join(parts), is_pkg, path


def _imports(name: str, is_pkg: bool, path: Path):
    """hpcps modules ``path`` imports (relative imports resolved), with their line numbers."""
    package = name if is_pkg else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] if node.module else [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            if t == "hpcps" or t.startswith("hpcps."):
                yield t, node.lineno


def _allowed(name: str) -> list:
    for prefix, allowed in LAYERS:
        if name == prefix or name.startswith(prefix + "."):
            return allowed
    raise AssertionError(f"{name} is in no layer: add it to LAYERS and to docs/design.md")


def _within(target: str, prefixes) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def test_every_module_imports_only_its_layer_or_below():
    bad = []
    for name, is_pkg, path in _modules():
        allowed = _allowed(name)
        own = name.split(".")[:2]
        for target, line in _imports(name, is_pkg, path):
            if target.split(".")[:2] == own and name != "hpcps":
                continue                        # within its own subpackage or module
            if not _within(target, allowed):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not bad, "imports against the layers (docs/design.md):\n" + "\n".join(bad)


def test_the_check_sees_a_violation(tmp_path):
    """The parser itself: a checkpoint module reaching into the sparse tables is caught."""
    f = tmp_path / "coordinator.py"
    f.write_text("from ..sparse.table import EmbeddingTable\nimport hpcps.core.window\n")
    got = [t for t, _ in _imports("hpcps.checkpoint.coordinator", False, f)]
    assert got == ["hpcps.sparse.table", "hpcps.core.window"]
    assert not _within(got[0], _allowed("hpcps.checkpoint.coordinator"))


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_start_no_mpi(module):
    code = f"import sys, {module}; assert 'mpi4py.MPI' not in sys.modules, sorted(m for m in sys.modules if 'hpcps' in m)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_import_hpcps_has_no_side_effects():
    """No restart, no MPI, no change to mpi4py's settings: only imports."""
    code = ("import os, sys, mpi4py; before = dict(vars(mpi4py.rc)); pid = os.getpid(); import hpcps; "
            "assert os.getpid() == pid and dict(vars(mpi4py.rc)) == before; "
            "assert 'mpi4py.MPI' not in sys.modules; print(hpcps.__version__)")
    r = subprocess.run([sys.executable, "-c", code, "train"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


def test_the_command_parser_starts_no_mpi():
    """hpcps.cli builds its parser (every subcommand's arguments) before prepare_process sets the MPI
    thread level and glibc's heap: nothing it imports may start MPI (hpcps plan's model did)."""
    code = "import sys; from hpcps.cli import _parser; _parser(); assert 'mpi4py.MPI' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_source_parses_as_the_oldest_python_setup_cfg_allows():
    """setup.cfg says python_requires >= 3.10: every module must parse as 3.10 (no 3.11+ syntax)."""
    text = (ROOT / "setup.cfg").read_text()
    assert "python_requires = >=3.10" in text
    for _, _, path in _modules():
        ast.parse(path.read_text(), str(path), feature_version=(3, 10))


@pytest.mark.parametrize("module", ["hpcps.sparse", "hpcps.core.dynshard", "hpcps.runtime.context", "hpcps.models",
                                    "hpcps.train", "hpcps.train.driver", "hpcps.train.tables"])
def test_the_table_layers_do_not_import_torch(module):
    """A program of tables alone (and every test launch of one) does not pay torch's import:
    seconds a rank on an oversubscribed node; the PS's optimizers import it when they first apply.
    Nor do the model kinds' registry, ``hpcps.train`` and its driver until a job runs (``hpcps plan``, ``--help``)."""
    code = f"import sys, {module}; assert 'torch' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_the_public_names_outlive_the_regrouping():
    """What README and docs/api.md show a user importing still imports, after the loose modules
    moved into packages (issue 52): the face's names, ``hpcps.optim`` as a module, ``hpcps.nn``."""
    code = ("import hpcps, hpcps.optim, hpcps.nn\n"
            "from hpcps.optim import SGD, Adagrad, Adam, FTRL, LRSchedule\n"
            "from hpcps.nn import ShardedEmbeddingBag, ShardedEmbeddingCollection, IdPlan\n"
            "assert hpcps.optim.Adagrad is Adagrad and hpcps.init.__module__ == 'hpcps.runtime.context'\n"
            "assert hpcps.HpcpsError.__module__ == 'hpcps.core.errors' and hpcps.nn.ShardedEmbeddingBag is ShardedEmbeddingBag\n"
            "assert {'EmbeddingTable', 'DenseSync', 'models', 'prepare_process'} <= set(dir(hpcps))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
