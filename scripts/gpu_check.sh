#!/usr/bin/env bash
# GPU checks (a CUDA machine; CI has no GPU): the NCCL path of DenseSync and a
# training run with the dense layers on the GPU. Runs in well under 5 minutes
# on one GPU. NCCL allows one rank per GPU, so with G GPUs the NCCL tests use
# G workers (on a single-GPU machine: 1 worker, which still bootstraps NCCL
# over MPI and all-reduces through it).
#   scripts/gpu_check.sh            (sets up .venv first, like scripts/run)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/run setup
py=.venv/bin/python
mpiexec="scripts/run mpiexec"
ngpu=$($py -c 'import torch; print(torch.cuda.device_count())')
echo "== GPUs seen by torch: $ngpu ($($py -c 'import torch; print(torch.__version__, torch.version.cuda)'))"
if [[ $ngpu -lt 1 ]]; then echo "no GPU: nothing to check here" >&2; exit 1; fi
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
echo "== DenseSync over NCCL ($ngpu worker(s))"
timeout 180 $mpiexec -n "$ngpu" $py -m pytest --with-mpi -q -p no:cacheprovider \
  tests/parallel/test_dense.py -k nccl -rA
echo "== hpcps train with model.device=cuda (1 PS + $ngpu worker(s)), dense all-reduce over NCCL"
out=$(mktemp -d)
timeout 240 $mpiexec -n $((ngpu + 1)) $py -m mpi4py -m hpcps train --config tests/configs/tiny_ctr.toml \
  --set model.device=cuda job.export="$out/gpu.npz" | tee "$out/final.json"
grep -q '"final"' "$out/final.json"
echo "== the GPU run equals single-process CPU PyTorch (float tolerance)"
$py - "$out/gpu.npz" "$ngpu" <<'PY'
import sys, numpy as np
from hpcps.config import load_config
from hpcps.tools.reference import train_reference
got = np.load(sys.argv[1])
ref = train_reference(load_config("tests/configs/tiny_ctr.toml", [], environ={}))
worst = max(float(np.abs(got[k] - ref[k]).max()) for k in ref)
print(f"max |gpu - cpu reference| = {worst:.2e}")
assert worst < 1e-3, worst
PY
echo "GPU checks passed"
