#!/usr/bin/env bash
# The GPU verification in one call on a machine with a GPU (issue: verify the CUDA paths), run from
# the checkout's root. Everything it finds goes under $OUT (default out/gpu):
#   env.txt            nvidia-smi, torch / CUDA / transformers versions, cores
#   doctor.txt         `posttrain doctor`'s log; gpu-report.md its report (tests, copies, ODC's device
#                      transport, flat ODC's engine overhead, offload on one Llama stage)
#   bench_*.txt        CPU benchmarks that need more cores than a 2-core machine has, run beside the
#                      doctor on other cores (taskset), each on its own cores
# Where packages are missing (no network), wheels in .whl/ are installed into /tmp/site first.
# Usage: bash scripts/gpu-verify.sh [cpu-benches: odc | pipeline | none]   (default odc)
# Environment: OUT, DOCTOR_TIMEOUT, BENCH_TIMEOUT, TEST_TIMEOUT (seconds), DOCTOR_ARGS, AFTER_DOCTOR (a command),
#   DOCTOR=0 (benchmarks only), PROFILE (the odc benchmarks' length profile, default long_tail).
set -u
OUT=${OUT:-out/gpu}
BENCHES=${1:-odc}
mkdir -p "$OUT"
set -o pipefail
export PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
# a hung test fails alone (pytest-timeout, where installed)
python3 -c "import pytest_timeout" 2>/dev/null && export PYTEST_ADDOPTS="--timeout=${TEST_TIMEOUT:-150} ${PYTEST_ADDOPTS:-}"
PY=${PY:-python3}
{ nvidia-smi; $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"; nproc; } >"$OUT/env.txt" 2>&1
cores=$(nproc)
if [ "$cores" -ge 16 ]; then
  GPU_CORES=0-3
  case $BENCHES in
    odc)
      ODC="$PY -m posttrain bench odc --profile ${PROFILE:-long_tail} --max-len 4096 --steps 4 --sweep --sequences-per-rank 4 --sweep-max-tokens 4096 --repeats 3 --json ''"
      taskset -c 4-7 timeout ${BENCH_TIMEOUT:-480} bash -c "$ODC --world-size 4" >"$OUT/bench_odc_w4.txt" 2>&1 &
      taskset -c 8-15 timeout ${BENCH_TIMEOUT:-480} bash -c "$ODC --world-size 8" >"$OUT/bench_odc_w8.txt" 2>&1 &
      ;;
    pipeline)
      PDP="$PY -m posttrain bench pipeline-dp --repeats 3 --json ''"
      taskset -c 4-7 timeout ${BENCH_TIMEOUT:-480} bash -c "$PDP --pp-size 2 --dp-size 2" >"$OUT/bench_pdp_2x2.txt" 2>&1 &
      taskset -c 8-15 timeout ${BENCH_TIMEOUT:-480} bash -c "$PDP --pp-size 2 --dp-size 4" >"$OUT/bench_pdp_2x4.txt" 2>&1 &
      ;;
  esac
else
  GPU_CORES=0-$((cores - 1))
fi
rc=0
if [ "${DOCTOR:-1}" = 1 ]; then
  taskset -c "$GPU_CORES" timeout ${DOCTOR_TIMEOUT:-500} $PY -m posttrain doctor --out "$OUT/gpu-report.md" ${DOCTOR_ARGS:-} 2>&1 | tee "$OUT/doctor.txt" || rc=$?
fi
# more GPU work after the doctor, while the CPU benchmarks still run (e.g. a measurement at another size)
if [ -n "${AFTER_DOCTOR:-}" ]; then taskset -c "$GPU_CORES" bash -c "$AFTER_DOCTOR" 2>&1 | tee "$OUT/after-doctor.txt"; fi
wait
echo "gpu-verify: done (doctor exit $rc); files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $rc
