import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# tests/parallel runs only under mpiexec (tests/test_parallel.py launches it);
# a plain serial run would skip every test in it.
collect_ignore = ["parallel", "programs"]
