#!/usr/bin/env bash
# The GPU verification, in two calls that each fit a device command (10 minutes) with room, run from
# the checkout's root on the GPU machine (15 minutes of machine time a session, its start included):
#
#   bash scripts/gpu-verify.sh tests                   (a) the CUDA tests: pytest -m cuda, every core
#   bash scripts/gpu-verify.sh measure [odc|cp|pipeline|demo|none]
#                                                      (b) posttrain doctor's measurements (copies, ODC's
#                                                          device transport, flat ODC's engine overhead,
#                                                          offload on a Llama stage: none, full and the
#                                                          planner's share); with odc or pipeline, two CPU
#                                                          benchmarks beside it on cores 4-15 and the doctor
#                                                          on 0-3 (cp: bench odc --context-parallel auto at
#                                                          4 and 8 ranks, 2 LongAlign-shaped sequences a
#                                                          rank, odc+cp against the even bound); with demo,
#                                                          posttrain demo at 4 ranks on cores 4-7 and 8 on
#                                                          8-15 (as with trl demo); with
#                                                          none (the default) the doctor on every core
#   bash scripts/gpu-verify.sh trl [demo]              (c) posttrain against TRL's SFTTrainer on the GPU
#                                                          (lab/bench/trl_sft.py: a 1.1B Llama, the same
#                                                          records, order and update; TRL padding-free, 4
#                                                          records in one row, as its docs advise; posttrain
#                                                          flat ODC and FSDP2; 2 rounds of 20 steps; the
#                                                          ratios against TRL's padding-free mode); about 6
#                                                          minutes on an H100 with checkpointing off;
#                                                          TRL_CHECKPOINTING=on for the second half (slower).
#                                                          With demo: the comparison on cores 0-3 and
#                                                          posttrain demo (variants step by step) at 4 ranks
#                                                          on cores 4-7 and 8 on 8-15, beside it: ODC's
#                                                          mechanism against the calibrated simulator's
#                                                          prediction at those ranks
#   bash scripts/gpu-verify.sh profile                 (d) one posttrain step profiled (flat ODC, world size 1,
#                                                          the TRL comparison's model and records: operators
#                                                          by self GPU and CPU time, scripts/profile_step/),
#                                                          about 1.5 minutes with the model made
#   bash scripts/gpu-verify.sh --dry-run [tests|measure]   here, on the CPU: the plan, the tests (a) would
#                                                          run and the time expected from the last recorded
#                                                          durations (scripts/gpu-durations.txt)
#
# Before the calls, here: python scripts/gpu_wheels.py --with trl==1.16.0 (the packages the image
# lacks, into .whl/; each call carries .whl). Everything found goes under $OUT (default out/gpu):
#   env.txt        nvidia-smi, torch / CUDA / transformers versions, cores
#   tests.txt      (a) pytest's log with --durations; durations.txt the per-test seconds, to commit as
#                  scripts/gpu-durations.txt so that the next run is planned from them
#   doctor.txt     (b) the doctor's log; gpu-report.md its report; bench_*.txt the CPU benchmarks
#                  (bench_cp_w4.txt, bench_cp_w8.txt: odc+cp against the even bound at 4 and 8 ranks)
#   trl_sft.txt    (c) the comparison's table and losses; trl_sft.json its figures; trl_profile.txt
#                  the profile of TRL's last warm-up step (with the variant trl); demo_w4.txt, demo_w8.txt
#                  (and .json) the demos beside it
#   prof_odc.txt   (d) the profile of posttrain's step; profile.txt the run's log
# Environment: OUT, PART_TIMEOUT (seconds for the part, default 460), TEST_TIMEOUT (per test, default
#   120), WORKERS (pytest-xdist workers for (a), default 3; 0: one process), PROFILE (odc benchmarks'
#   length profile, default long_tail), DOCTOR_ARGS, PY; for (c) TRL_VARIANTS (default
#   trl-pf:4,odc,fsdp; add trl for one record a forward), TRL_ROUNDS (2), TRL_STEPS (20, 2 of them warm-up),
#   TRL_CHECKPOINTING, TRL_DIR, DEMO_ROUNDS (5).
set -u
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
PART=${1:-}
case $PART in
  tests|measure|trl|profile) ;;
  *) echo "usage: bash scripts/gpu-verify.sh [--dry-run] tests|measure [odc|pipeline|demo|none]|trl [demo]|profile" >&2; exit 2 ;;
esac
BENCHES=${2:-none}
case $PART:$BENCHES in
  measure:odc|measure:cp|measure:pipeline|measure:demo|*:none|trl:demo) ;;
  measure:*) echo "gpu-verify: what runs beside (b) is odc, cp, pipeline, demo or none, not '$BENCHES'" >&2; exit 2 ;;
  trl:*) echo "gpu-verify: what runs beside (c) is demo or none, not '$BENCHES'" >&2; exit 2 ;;
  *) echo "gpu-verify: part '$PART' takes nothing after it, not '$BENCHES'" >&2; exit 2 ;;
esac
OUT=${OUT:-out/gpu}
if [ -x .venv/bin/python ]; then PY=${PY:-.venv/bin/python}; else PY=${PY:-python3}; fi
PART_TIMEOUT=${PART_TIMEOUT:-460}
TEST_TIMEOUT=${TEST_TIMEOUT:-120}
WORKERS=${WORKERS:-3}
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}

TRL_ARGS="--dir ${TRL_DIR:-/tmp/trl_sft} --variants ${TRL_VARIANTS:-trl-pf:4,odc,fsdp} --rounds ${TRL_ROUNDS:-2} --steps ${TRL_STEPS:-20} --warmup 2 --timeout 150 --checkpointing ${TRL_CHECKPOINTING:-off}"
DEMO="$PY -m posttrain demo --rounds ${DEMO_ROUNDS:-5} --plot ''"
# context parallelism at 4 and 8 ranks (the 2-rank setting of docs/results.md's bench-odc-cp per rank:
# 2 LongAlign-shaped sequences a rank up to 4,096 tokens); add --sequences 8|16 and --world-size 4|8
CP="$PY -m posttrain bench odc --profile longalign --max-len 4096 --max-tokens 4096 --steps 8 --repeats 3 --context-parallel auto --no-predict --json ''"
if [ "$DRY" = 1 ]; then
  echo "gpu-verify (dry run) of part '$PART' on this machine; on the GPU machine it would:"
  if [ "$PART" = trl ]; then
    if [ "$BENCHES" = demo ]; then
      echo "  - on cores 4-7 and 8-15, beside (c): $DEMO --world-size 4|8 --sequences 16|32 --json \$OUT/demo_w4|8.json"
      echo "  - on cores 0-3:"
    fi
    echo "  - run python -m posttrain.lab.bench.trl_sft compare $TRL_ARGS --profile \$OUT/trl_profile.txt, cut at $PART_TIMEOUT s"
    exit 0
  fi
  if [ "$PART" = profile ]; then
    echo "  - make the TRL comparison's 1.1B model and records in ${TRL_DIR:-/tmp/trl_sft} (kept if there), then"
    echo "    PROFILE_STEP=3 PROFILE_STEP_OUT=\$OUT/prof_odc.txt posttrain train --dp odc --world-size 1 ... --steps 5"
    exit 0
  fi
  echo "  - install .whl/*.whl into /tmp/site ($(ls .whl/*.whl 2>/dev/null | wc -l) wheels here; make them with scripts/gpu_wheels.py)"
  if [ "$PART" = tests ]; then
    echo "  - run pytest -m cuda with $WORKERS workers, $TEST_TIMEOUT s a test, the part cut at $PART_TIMEOUT s:"
    $PY -m pytest -q --collect-only -m cuda -p no:cacheprovider tests 2>/dev/null | grep "::" >"${TMPDIR:-/tmp}/gpu-tests.txt"
    $PY scripts/gpu_plan.py "${TMPDIR:-/tmp}/gpu-tests.txt" scripts/gpu-durations.txt "$WORKERS" "$TEST_TIMEOUT" "$PART_TIMEOUT"
    exit $?
  fi
  if [ "$BENCHES" = cp ]; then
    echo "  - on cores 4-7 and 8-15, beside the doctor: $CP --sequences 8|16 --world-size 4|8 > \$OUT/bench_cp_w4|8.txt"
  fi
  if [ "$BENCHES" = none ]; then cores="every core"; else cores="cores 0-3, with $BENCHES benchmarks on 4-15"; fi
  echo "  - run posttrain doctor --no-tests on $cores: devices, copies, ODC's device transport, flat ODC's engine"
  echo "    overhead, offload on a Llama stage; cut at $PART_TIMEOUT s (the H200 run of 2026-11-26 took about"
  echo "    6 minutes for tests and measurements together with the benchmarks beside it: docs/results.md)"
  exit 0
fi

mkdir -p "$OUT"
set -o pipefail
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{ nvidia-smi; $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"; nproc; } >"$OUT/env.txt" 2>&1
cores=$(nproc)
rc=0
# posttrain demo at 4 ranks on cores 4-7 and 8 on cores 8-15, beside (b) or (c); wait_demos fails the
# part when one failed (its log says why)
start_demos() {
  taskset -c 4-7 timeout "$PART_TIMEOUT" bash -c "$DEMO --world-size 4 --sequences 16 --json $OUT/demo_w4.json" \
    >"$OUT/demo_w4.txt" 2>&1 &
  d4=$!
  taskset -c 8-15 timeout "$PART_TIMEOUT" bash -c "$DEMO --world-size 8 --sequences 32 --json $OUT/demo_w8.json" \
    >"$OUT/demo_w8.txt" 2>&1 &
  d8=$!
}
wait_demos() {
  wait "$d4" || { rc=$?; echo "gpu-verify: the 4-rank demo exited $rc: $OUT/demo_w4.txt"; }
  wait "$d8" || { rc=$?; echo "gpu-verify: the 8-rank demo exited $rc: $OUT/demo_w8.txt"; }
}
if [ "$PART" = tests ]; then
  xdist=""
  if [ "$WORKERS" -gt 0 ] && $PY -c "import xdist" 2>/dev/null; then xdist="-n $WORKERS"; fi
  tmo=""
  $PY -c "import pytest_timeout" 2>/dev/null && tmo="--timeout=$TEST_TIMEOUT"
  timeout "$PART_TIMEOUT" $PY -m pytest -q -m cuda -p no:cacheprovider $xdist $tmo --durations=0 -rfE tests 2>&1 \
    | tee "$OUT/tests.txt" || rc=$?
  # per-test seconds (call phase, setup and teardown summed) for the next run's plan
  $PY - "$OUT/tests.txt" >"$OUT/durations.txt" <<'EOF'
import re, sys
total = {}
for line in open(sys.argv[1]):
    m = re.match(r"^\s*([0-9.]+)s (?:call|setup|teardown)\s+(\S+)", line)
    if m:
        total[m.group(2)] = total.get(m.group(2), 0.0) + float(m.group(1))
for test, s in sorted(total.items()):
    print(f"{s:.1f} {test}")
EOF
elif [ "$PART" = profile ]; then
  D=${TRL_DIR:-/tmp/trl_sft}
  timeout "$PART_TIMEOUT" bash -c "$PY -c \"from posttrain.lab.bench.trl_sft import prepare; prepare('$D', '1b', 256, 4096, device='cuda')\" && \
    PROFILE_STEP=3 PROFILE_STEP_OUT=$OUT/prof_odc.txt PYTHONPATH=$PWD/scripts/profile_step:\$PYTHONPATH $PY -m posttrain train \
    --data $D/train.jsonl --model-path $D/model --dp odc --world-size 1 --device cuda --precision bf16 --sequences 16 \
    --max-tokens 4096 --steps 5 --lr 1e-4 --max-grad-norm 1.0 --balance diff_micro --seed 0" 2>&1 | tee "$OUT/profile.txt" || rc=$?
elif [ "$PART" = trl ]; then
  pin=""
  if [ "$BENCHES" = demo ]; then
    if [ "$cores" -lt 16 ]; then echo "gpu-verify: the demos beside (c) need 16 cores, this machine has $cores" >&2; exit 2; fi
    pin="taskset -c 0-3"
    start_demos
  fi
  timeout "$PART_TIMEOUT" $pin $PY -m posttrain.lab.bench.trl_sft compare $TRL_ARGS --profile "$OUT/trl_profile.txt" \
    --out "$OUT/trl_sft.json" 2>&1 | tee "$OUT/trl_sft.txt" || rc=$?
  if [ "$BENCHES" = demo ]; then wait_demos; fi
else
  if [ "$cores" -ge 16 ] && [ "$BENCHES" != none ]; then
    GPU_CORES=0-3
    case $BENCHES in
      odc)
        ODC="$PY -m posttrain bench odc --profile ${PROFILE:-long_tail} --max-len 4096 --steps 4 --sweep --sequences-per-rank 4 --sweep-max-tokens 4096 --repeats 3 --json ''"
        taskset -c 4-7 timeout "$PART_TIMEOUT" bash -c "$ODC --world-size 4" >"$OUT/bench_odc_w4.txt" 2>&1 &
        taskset -c 8-15 timeout "$PART_TIMEOUT" bash -c "$ODC --world-size 8" >"$OUT/bench_odc_w8.txt" 2>&1 &
        ;;
      cp)
        taskset -c 4-7 timeout "$PART_TIMEOUT" bash -c "$CP --sequences 8 --world-size 4" >"$OUT/bench_cp_w4.txt" 2>&1 &
        taskset -c 8-15 timeout "$PART_TIMEOUT" bash -c "$CP --sequences 16 --world-size 8" >"$OUT/bench_cp_w8.txt" 2>&1 &
        ;;
      pipeline)
        PDP="$PY -m posttrain bench pipeline-dp --repeats 3 --json ''"
        taskset -c 4-7 timeout "$PART_TIMEOUT" bash -c "$PDP --pp-size 2 --dp-size 2" >"$OUT/bench_pdp_2x2.txt" 2>&1 &
        taskset -c 8-15 timeout "$PART_TIMEOUT" bash -c "$PDP --pp-size 2 --dp-size 4" >"$OUT/bench_pdp_2x4.txt" 2>&1 &
        ;;
      demo) start_demos ;;
    esac
  else
    GPU_CORES=0-$((cores - 1))
  fi
  taskset -c "$GPU_CORES" timeout "$PART_TIMEOUT" $PY -m posttrain doctor --no-tests --out "$OUT/gpu-report.md" \
    ${DOCTOR_ARGS:-} 2>&1 | tee "$OUT/doctor.txt" || rc=$?
  if [ "$BENCHES" = demo ] && [ -n "${d4:-}" ]; then wait_demos; fi
  wait
fi
echo "gpu-verify $PART: done (exit $rc); files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $rc
