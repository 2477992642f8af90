#!/usr/bin/env bash
# GPU check for issue 8: on a machine with a CUDA GPU, run the GPU tests
# (pytest -m gpu) and the GPU benchmarks (bench/gpu_bench.py) in under 8
# minutes, with every figure written to one folder:
#
#   OUT/env.txt          GPUs, driver, torch / CUDA versions
#   OUT/pytest.log       the gpu-marked tests (OUT/pytest.xml: JUnit)
#   OUT/gpu_bench.json   multi-stream speedup over eager CUDA (batch 1 and 8, the zoo),
#   OUT/gpu_bench.md     simulator error against measured GPU makespans, and with
#                        two or more GPUs maestro / the learned policy vs one GPU
#   OUT/omp_teams.md     this machine's many cores: eager PyTorch's step with a second
#                        OpenMP team alive vs retired (bench/omp_teams.py; 2 cores
#                        elsewhere cannot show it for real plans)
#   OUT/summary.md       what ran, exit codes, the benchmark tables
#
# Usage: bench/gpu_check.sh [--out DIR] [--quick]
#   --out DIR   output folder (default runs/gpu_check_<timestamp>)
#   --quick     smoke run: two models, batch 1, few rounds
#
# Exit status: 0 all passed; 1 GPU tests failed; 2 the benchmark failed or
# timed out; 3 no CUDA GPU here (nothing is run and nothing is written);
# 64 bad arguments.  It checks for CUDA before any heavy work.
set -u

cd "$(dirname "$0")/.." || exit 2
OUT=""
QUICK=""
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT="${2:-}"; [ -n "$OUT" ] || { echo "gpu_check: --out needs a folder" >&2; exit 64; }; shift 2 ;;
        --out=*) OUT="${1#--out=}"; shift ;;
        --quick) QUICK="--quick"; shift ;;
        -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check: unknown argument '$1' (try --help)" >&2; exit 64 ;;
    esac
done

if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi

# 1. Is there a GPU?  (torch import only; nothing else runs without one.)
"$PY" - <<'EOF'
import sys
try:
    import torch
except ImportError as exc:
    print(f"gpu_check: no CUDA GPU: torch is not importable here ({exc})", file=sys.stderr)
    sys.exit(3)
if not torch.cuda.is_available():
    build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
    print(f"gpu_check: no CUDA GPU is visible to torch {torch.__version__} ({build}); "
          "nothing was run or measured. Run this script on a machine with an NVIDIA GPU.", file=sys.stderr)
    sys.exit(3)
sys.exit(0)
EOF
rc=$?
if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 3 ] || echo "gpu_check: the CUDA check itself failed (exit $rc)" >&2
    exit 3
fi

# 2. The output folder and the environment.
[ -n "$OUT" ] || OUT="runs/gpu_check_$(date +%Y%m%d_%H%M%S)"
mkdir -p "$OUT" || { echo "gpu_check: cannot create $OUT" >&2; exit 2; }
START=$(date +%s)
{
    echo "date: $(date -Iseconds)"
    echo "host: $(hostname)"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
} > "$OUT/env.txt" 2>&1
echo "gpu_check: GPU found; writing to $OUT"
cat "$OUT/env.txt"

run_limited() {  # run_limited SECONDS cmd...: stop a command that outlives its share of the 8 minutes
    local secs=$1; shift
    if command -v timeout >/dev/null; then timeout --kill-after=10 "$secs" "$@"; else "$@"; fi
}

# 3. The GPU tests (about 3 minutes at most).
echo "gpu_check: running the gpu-marked tests"
run_limited 200 "$PY" -m pytest -m gpu tests -q -p no:cacheprovider --junitxml="$OUT/pytest.xml" 2>&1 | tee "$OUT/pytest.log"
TESTS_RC=${PIPESTATUS[0]}

# 3b. A second OpenMP team on this machine's cores (about 20 s; its failure fails nothing else).
echo "gpu_check: running bench/omp_teams.py"
run_limited 60 "$PY" bench/omp_teams.py --out "$OUT" 2>&1 | tee "$OUT/omp_teams.log"
OMP_RC=${PIPESTATUS[0]}

# 4. The GPU benchmarks (what is left of the 8 minutes, with a margin).
ELAPSED=$(( $(date +%s) - START ))
LEFT=$(( 450 - ELAPSED ))
[ "$LEFT" -gt 60 ] || LEFT=60
BUDGET=$(( LEFT - 40 ))
echo "gpu_check: running bench/gpu_bench.py (budget ${BUDGET}s)"
run_limited "$LEFT" "$PY" bench/gpu_bench.py --out "$OUT" --budget-s "$BUDGET" $QUICK 2>&1 | tee "$OUT/gpu_bench.log"
BENCH_RC=${PIPESTATUS[0]}

# 5. Summary.
{
    echo "# gpu_check $(date -Iseconds)"
    echo
    echo "- GPU tests: exit $TESTS_RC ($(tail -n 1 "$OUT/pytest.log"))"
    echo "- benchmarks: exit $BENCH_RC"
    echo "- omp_teams: exit $OMP_RC"
    echo "- wall time: $(( $(date +%s) - START )) s"
    echo
    [ -f "$OUT/gpu_bench.md" ] && cat "$OUT/gpu_bench.md"
    [ -f "$OUT/omp_teams.md" ] && { echo; cat "$OUT/omp_teams.md"; }
} > "$OUT/summary.md"
echo "gpu_check: done in $(( $(date +%s) - START )) s; see $OUT/summary.md"

# pytest exits 5 when it collects no gpu-marked test: that is a failure here too.
[ "$TESTS_RC" -eq 0 ] || exit 1
[ "$BENCH_RC" -eq 0 ] || exit 2
exit 0
