#!/usr/bin/env bash
# The GPU acceptance path, on an NVIDIA machine (no package registry needed): the `gpu` test tier,
# `gpuyard hw` on real NVML, `gpuyard fabric bench` with NCCL (2+ GPUs), calibration,
# predict-then-measure and bf16 MFU. Uses the machine's own PyTorch; gpuyard's other dependencies
# come from wheels/ (`make gpu-wheels` on a machine with a registry). Every output goes to
# $GPU_CHECK_OUT (default gpu-check/), one log per step; a failed step is reported, the rest still run.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${GPU_CHECK_OUT:-gpu-check}
py=${PYTHON:-python3}
mkdir -p "$out"
# The wheels and the venv go to a private folder of this run (mktemp -d: 0700, a fresh name), never
# to a fixed /tmp path another user could have prepared; GPU_CHECK_SITE / GPU_CHECK_VENV name others.
work=$(mktemp -d -t gpuyard-check.XXXXXXXX) || { echo "gpu-check: mktemp failed" >&2; exit 2; }
site=${GPU_CHECK_SITE:-$work/site}

if ! "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu-check: no CUDA device visible to $py's PyTorch; this path is for an NVIDIA machine" >&2
  exit 2
fi
if [ -d wheels ] && ls wheels/*.whl >/dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" wheels/*.whl \
    || { echo "gpu-check: installing wheels/ failed" >&2; exit 2; }
fi
# gpuyard as installed, not through PYTHONPATH: the programs it runs as itself (the GPU self-test)
# get a clean environment with no PYTHON* variables. A venv holds a .pth that adds the machine
# interpreter's own packages (its PyTorch; that interpreter may itself be a venv, which
# --system-site-packages would skip) and puts src/ and the wheels first, as PYTHONPATH did.
venv=${GPU_CHECK_VENV:-$work/venv}
"$py" -m venv --clear --without-pip "$venv" || { echo "gpu-check: making $venv failed" >&2; exit 2; }
parent=$("$py" -c 'import sysconfig as s; p = s.get_paths(); print(repr(sorted({p["purelib"], p["platlib"]})))')
purelib=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf 'import site, sys; list(map(site.addsitedir, %s)); sys.path[:0] = [%s, %s]\n' \
  "$parent" "'$PWD/src'" "'$site'" >"$purelib/gpuyard-check.pth"
"$venv/bin/python" -c 'import torch, gpuyard' || { echo "gpu-check: $venv sees no torch or gpuyard" >&2; exit 2; }
py=$venv/bin/python
export PYTHONUNBUFFERED=1
gy() { "$py" -m gpuyard.cli.main "$@"; }

failed=()
step() {  # step NAME COMMAND...: run, log to $out/NAME.log, remember failures
  local name=$1; shift
  echo "== $name: $*"
  if "$@" >"$out/$name.log" 2>&1; then tail -n 3 "$out/$name.log"; else
    echo "   FAILED (exit $?), last lines:"; tail -n 15 "$out/$name.log"; failed+=("$name"); fi
}

ngpu=$("$py" -c 'import torch; print(torch.cuda.device_count())')
step nvidia-smi nvidia-smi
step gpu-tests "$py" -m pytest -m gpu tests/gpu -q -p no:cacheprovider
step hw gy hw --json
if [ "$ngpu" -ge 2 ]; then
  step nccl-bench gy fabric bench --backend nccl --nproc "$ngpu" --sizes 8KiB:1GiB --json
else
  echo "== nccl-bench: skipped, NCCL collectives need 2 GPUs or more (this machine has $ngpu)"
fi
step calibrate gy fabric calibrate --out "$out/calibration.json"
step predict-measure "$py" benchmarks/predict_measure.py --calibration "$out/calibration.json"
step mfu "$py" benchmarks/mfu.py
# The planner on this machine with its calibration: the 1.2B shape of benchmarks/mfu.py.
model=$(mktemp --suffix .yaml)
printf 'layers: 22\nhidden: 2048\nheads: 16\nkv_heads: 16\nffn_hidden: 8192\nvocab: 32768\nseq_len: 2048\n' >"$model"
step plan-calibrated gy plan --model "$model" --cluster local --gpus "$ngpu" --global-batch 4 \
  --calibration "$out/calibration.json"

if [ ${#failed[@]} -gt 0 ]; then echo "gpu-check: failed steps: ${failed[*]}; gpuyard's interpreter: $venv/bin/python"; exit 1; fi
echo "gpu-check: all steps passed; logs in $out/; gpuyard's interpreter: $venv/bin/python"
