#!/bin/bash
# Chained jobs, for sites without requeue: submit N copies of slurm/train.sbatch that run one
# after another (--dependency=singleton: one job of this name and user at a time). Each run
# checkpoints before its time limit and exits; the next one resumes from the newest checkpoint;
# once training is finished, the jobs left over resume, see there is nothing to do, and exit 0
# at once (cancel them with `scancel --name=<job name>` if you like).
#
#   slurm/chain.sh N [sbatch options ...] [-- train options ...]
#   HPCPS_CKPT_DIR=/lustre/$USER/ckpt/run1 slurm/chain.sh 5 --time=04:00:00 -- --set job.steps=200000
#
# The settings of train.sbatch apply (HPCPS_CONFIG, HPCPS_CKPT_DIR, ...); the job name is
# HPCPS_JOB_NAME (default hpcps-train), and the chain's jobs share HPCPS_CKPT_DIR (default
# ckpt/<job name>). Prints the job ids. Use --dependency=afterany:<id> chains by hand the same way.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
n=${1:?usage: slurm/chain.sh N [sbatch options ...] [-- train options ...]}
shift
sbatch_opts=()
while (($#)) && [[ $1 != -- ]]; do sbatch_opts+=("$1"); shift; done
(($#)) && shift
name=${HPCPS_JOB_NAME:-hpcps-train}
export HPCPS_CKPT_DIR=${HPCPS_CKPT_DIR:-ckpt/$name}
export HPCPS_MAX_RESTARTS=0 HPCPS_CHAINED=1
for ((i = 1; i <= n; i++)); do
  sbatch --parsable --job-name="$name" --dependency=singleton --no-requeue "${sbatch_opts[@]}" \
      "$here/train.sbatch" "$@"
done
