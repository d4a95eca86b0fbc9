#!/usr/bin/env bash
# GPU check: on one CUDA machine with no network, run the offline kernel compile check
# (scripts/compile_kernels.py, as `tox -e compile`), the GPU tests (`pytest -m gpu`, the same
# tests as `tox -e gpu`: compiled Triton and flash-attn against the oracle machine, CUDA
# graphs against eager decode, NCCL TP=2 against TP=1 when the machine has two devices, else
# reported as "skipped: 1 device") and the GPU benchmarks (bench/test_gpu_bench.py), and write a
# short report: passed/failed, decode-attention bandwidth, end-to-end tokens/s.
#
#   scripts/gpu-check.sh            # report in $OUT/gpu-report.md, else ./gpu-report.md
#
# Budget-aware: the whole run stays under GPU_CHECK_BUDGET_S seconds (default 450, i.e.
# 7.5 minutes: one call of at most 8 minutes on one H200). Each phase runs under `timeout`,
# capped by what is left; a phase cut short is reported as such, with whatever it finished.
#
# Python: a CUDA-capable torch that is already installed is used as is (PYTHON=... picks
# the interpreter; otherwise python3/python on PATH). Nothing is installed when every
# package the tests need is importable (the repository is put on PYTHONPATH). Otherwise the
# script tries `pip install -e .[test,bench]` into a venv that sees the system's packages
# (so the installed CUDA torch stays), and with no CUDA torch at all a plain venv with
# `-c constraints.txt`; offline, those attempts fail fast and the report says what is
# missing. flash-attn is optional: its absence is reported, its tests and comparisons skip.
#
# Exit status: 0 when the compile check passed and the GPU tests ran with none failing; 1
# otherwise. Benchmark figures are reported against their targets, never turned into a failure.

set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT" || exit 1

OUT_DIR="${OUT:-$ROOT}"
REPORT="$OUT_DIR/gpu-report.md"
LOGS="$OUT_DIR/gpu-logs"
RESULTS="$OUT_DIR/gpu-bench.jsonl"
BUDGET="${GPU_CHECK_BUDGET_S:-450}"
COMPILE_S="${GPU_CHECK_COMPILE_S:-60}"
TESTS_S="${GPU_CHECK_TESTS_S:-200}"
KERNEL_S="${GPU_CHECK_KERNEL_S:-75}"
RESERVE_S=15 # kept back for the report
mkdir -p "$LOGS"
rm -f "$RESULTS"
START=$SECONDS

log() { printf '[gpu-check %3ds] %s\n' "$((SECONDS - START))" "$*" >&2; }

# Seconds a phase may take: what it asks for, capped by the budget left.
phase_limit() {
    local want=$1 left=$((BUDGET - (SECONDS - START) - RESERVE_S))
    if ((left < want)); then want=$left; fi
    echo "$want"
}

# ---- 1. a Python with CUDA torch ---------------------------------------------------------

has_cuda_torch() {
    "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}

find_cuda_python() {
    local py cands=()
    if [[ -n "${PYTHON:-}" ]]; then cands+=("$PYTHON"); fi
    cands+=(python3 python /usr/bin/python3 /usr/local/bin/python3 /opt/conda/bin/python)
    for py in "${cands[@]}"; do
        command -v "$py" >/dev/null 2>&1 || continue
        if has_cuda_torch "$py"; then
            command -v "$py"
            return 0
        fi
    done
    return 1
}

REQUIRED="torch triton xxhash numpy transformers safetensors tokenizers tqdm pytest hypothesis"
missing_modules() { # prints the required modules that $1 cannot import
    "$1" - "$REQUIRED" <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1].split() if importlib.util.find_spec(m) is None))
EOF
}

PIP_QUIET=(--quiet --retries 0 --timeout 10 --disable-pip-version-check)
SETUP_NOTES=()
PY=""
if PY="$(find_cuda_python)"; then
    SETUP_NOTES+=("Python: \`$PY\` with its installed CUDA torch (nothing reinstalled).")
    missing="$(missing_modules "$PY")"
    if [[ -n "$missing" ]]; then
        log "missing: $missing; trying pip install -e .[test,bench] in .gpu-venv (system packages visible)"
        SETUP_NOTES+=("Missing from that Python: $missing; tried \`pip install -e .[test,bench]\` in .gpu-venv (--system-site-packages).")
        if "$PY" -m venv --system-site-packages .gpu-venv >"$LOGS/setup.log" 2>&1 &&
            timeout 180 .gpu-venv/bin/python -m pip install "${PIP_QUIET[@]}" --no-build-isolation \
                -e ".[test,bench]" >>"$LOGS/setup.log" 2>&1 &&
            has_cuda_torch .gpu-venv/bin/python; then
            PY="$ROOT/.gpu-venv/bin/python"
            SETUP_NOTES+=("Installed; using \`$PY\`.")
        else
            SETUP_NOTES+=("The install failed (no network?): see gpu-logs/setup.log.")
        fi
    fi
else
    log "no Python with a CUDA-capable torch; trying a venv with pip install -c constraints.txt"
    SETUP_NOTES+=("No Python with a CUDA-capable torch was found (tried \${PYTHON}, python3, python).")
    if python3 -m venv .gpu-venv >"$LOGS/setup.log" 2>&1 &&
        timeout 300 .gpu-venv/bin/python -m pip install "${PIP_QUIET[@]}" -c constraints.txt \
            -e ".[test,bench]" >>"$LOGS/setup.log" 2>&1 &&
        has_cuda_torch .gpu-venv/bin/python; then
        PY="$ROOT/.gpu-venv/bin/python"
        SETUP_NOTES+=("Installed \`-e .[test,bench]\` with constraints.txt into .gpu-venv; its torch sees CUDA.")
    else
        PY=""
        SETUP_NOTES+=("Installing into .gpu-venv failed or gave a torch without CUDA: see gpu-logs/setup.log.")
    fi
fi

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET # compiled kernels on the GPU
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export GPU_BENCH_RESULTS="$RESULTS"

ENV_MD="$LOGS/env.md"
READY=0
if [[ -n "$PY" ]]; then
    missing="$(missing_modules "$PY")"
    if [[ -z "$missing" ]]; then READY=1; else SETUP_NOTES+=("Still missing: $missing."); fi
    "$PY" - >"$ENV_MD" 2>>"$LOGS/setup.log" <<'EOF'
import importlib, importlib.metadata as md
import torch
try:
    p = torch.cuda.get_device_properties(0)
    print(f"- device: {p.name} x{torch.cuda.device_count()}, {p.total_memory / 2**30:.0f} GiB, "
          f"compute capability {p.major}.{p.minor}, {p.multi_processor_count} SMs")
except Exception as e:  # still list the packages
    print(f"- device: cannot be queried ({type(e).__name__}: {e})")
print(f"- torch {torch.__version__} (CUDA {torch.version.cuda})")
for dist in ("triton", "flash-attn", "transformers", "hypothesis", "pytest", "pytest-benchmark"):
    try:
        print(f"- {dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        note = " (optional: its tests and comparisons are skipped)" if dist == "flash-attn" else ""
        print(f"- {dist}: not installed{note}")
EOF
fi
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
        >"$LOGS/nvidia-smi.txt" 2>&1 || true
fi

# ---- 2. the phases -------------------------------------------------------------------------

declare -A STATUS SECS

# run_phase NAME WANT_SECONDS pytest-args...: runs pytest verbosely into gpu-logs/NAME.log.
run_phase() {
    local name=$1 want=$2 limit rc t0=$SECONDS
    shift 2
    limit="$(phase_limit "$want")"
    if ((limit < 20)); then
        STATUS[$name]="not run: ${limit}s left for it in the ${BUDGET}s budget"
        log "$name: skipped (budget)"
        return
    fi
    log "$name: pytest $* (limit ${limit}s)"
    timeout -k 10 "$limit" "$PY" -m pytest -p no:cacheprovider -v "$@" \
        >"$LOGS/$name.log" 2>&1
    rc=$?
    SECS[$name]=$((SECONDS - t0))
    case $rc in
    0) STATUS[$name]="ok" ;;
    5) STATUS[$name]="ok (nothing selected)" ;;
    124 | 137) STATUS[$name]="TIMED OUT after ${limit}s (results below are partial)" ;;
    *) STATUS[$name]="FAILED (pytest exit $rc)" ;;
    esac
    log "$name: ${STATUS[$name]} in ${SECS[$name]}s"
}

# outcome NAME WORD: how many tests of the phase ended with WORD (PASSED, FAILED, ...).
outcome() {
    local n
    n="$(grep -cE "^[^ ]+::[^ ]+ $2( |$)" "$LOGS/$1.log" 2>/dev/null)"
    echo "${n:-0}"
}

# run_cmd_phase NAME WANT_SECONDS command...: like run_phase, for a command that is not pytest.
run_cmd_phase() {
    local name=$1 want=$2 limit rc t0=$SECONDS
    shift 2
    limit="$(phase_limit "$want")"
    if ((limit < 20)); then
        STATUS[$name]="not run: ${limit}s left for it in the ${BUDGET}s budget"
        return
    fi
    log "$name: $* (limit ${limit}s)"
    timeout -k 10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    SECS[$name]=$((SECONDS - t0))
    case $rc in
    0) STATUS[$name]="ok" ;;
    124 | 137) STATUS[$name]="TIMED OUT after ${limit}s" ;;
    *) STATUS[$name]="FAILED (exit $rc)" ;;
    esac
    log "$name: ${STATUS[$name]} in ${SECS[$name]}s"
}

if ((READY)); then
    # Offline compiles need no GPU, but this machine has the cores to run them quickly.
    run_cmd_phase compile "$COMPILE_S" "$PY" scripts/compile_kernels.py --jobs 8 \
        --json "$OUT_DIR/compile-kernels.json"
    run_phase tests "$TESTS_S" -m gpu tests
    run_phase kernel-bench "$KERNEL_S" -m gpu bench/test_gpu_bench.py -k decode_attention -s
    run_phase e2e-bench "$BUDGET" -m gpu bench/test_gpu_bench.py -k end_to_end -s
else
    for name in compile tests kernel-bench e2e-bench; do STATUS[$name]="not run: no usable Python"; done
fi

# ---- 3. the report -------------------------------------------------------------------------

# tp_outcome LOG: the NCCL TP=2 test's verdict from the tests phase's log: it runs when the
# machine has two CUDA devices, and skips otherwise with the reason "skipped: 1 device".
tp_outcome() {
    local line
    line="$(grep -E '^tests/test_tp\.py::test_nccl_tp2[^ ]* ' "$1" 2>/dev/null | head -1)"
    case "$line" in
    *" PASSED"*) echo "passed: TP=2 over NCCL is token-identical to TP=1" ;;
    *" SKIPPED"*) # the reason, from -ra's summary (-v cuts it to the line's width)
        grep -m1 -oE 'skipped: [0-9]+ devices?' <(grep -E '^SKIPPED .*NCCL TP=2' "$1") ||
            echo "skipped" ;;
    *" FAILED"* | *" ERROR"*) echo "FAILED: see gpu-logs/tests.log" ;;
    *) echo "not run" ;;
    esac
}

tests_ok=0
if [[ "${STATUS[tests]}" == ok* ]] && [[ "${STATUS[compile]}" == ok ]] &&
    (($(outcome tests FAILED) + $(outcome tests ERROR) == 0)); then
    tests_ok=1
fi

{
    echo "# GPU check"
    echo
    commit="$(git rev-parse --short HEAD 2>/dev/null || echo 'unknown')"
    if [[ "$commit" != unknown ]] && ! git diff --quiet HEAD 2>/dev/null; then
        commit="$commit (with uncommitted changes)"
    fi
    echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $commit," \
        "total $((SECONDS - START))s of a ${BUDGET}s budget."
    echo
    if ((tests_ok)); then echo "**Compile check and GPU tests: PASSED**"; else echo "**Compile check or GPU tests: FAILED or not run**"; fi
    echo
    echo "## Environment"
    echo
    for note in "${SETUP_NOTES[@]}"; do echo "- $note"; done
    if [[ -s "$ENV_MD" ]]; then cat "$ENV_MD"; fi
    if [[ -s "$LOGS/nvidia-smi.txt" ]]; then echo "- nvidia-smi: $(head -1 "$LOGS/nvidia-smi.txt")"; fi
    echo
    echo "## Tests (\`pytest -m gpu tests\`, as \`tox -e gpu\`)"
    echo
    echo "${STATUS[tests]}${SECS[tests]:+, ${SECS[tests]}s}: $(outcome tests PASSED) passed," \
        "$(outcome tests FAILED) failed, $(outcome tests ERROR) errors, $(outcome tests SKIPPED) skipped."
    if [[ -f "$LOGS/tests.log" ]]; then
        fails="$(grep -E '^(FAILED|ERROR) ' "$LOGS/tests.log" | head -20)"
        if [[ -n "$fails" ]]; then
            echo
            echo '```'
            echo "$fails"
            echo '```'
        fi
        skips="$(grep -E '^SKIPPED ' "$LOGS/tests.log" | head -10)"
        if [[ -n "$skips" ]]; then
            echo
            echo "Skipped:"
            echo '```'
            echo "$skips"
            echo '```'
        fi
    fi
    echo
    echo "## Tensor parallelism (NCCL TP=2, \`tests/test_tp.py\`, in the tests above)"
    echo
    echo "$(tp_outcome "$LOGS/tests.log")"
    echo
    echo "## Offline kernel compiles (\`scripts/compile_kernels.py\`)"
    echo
    echo "${STATUS[compile]}${SECS[compile]:+, ${SECS[compile]}s}; every figure: compile-kernels.json."
    if [[ -f "$LOGS/compile.log" ]]; then
        echo
        echo '```'
        grep -E '^(FAIL|warning|OK|FAILED|[0-9]+ cases)' "$LOGS/compile.log" | head -20
        echo '```'
    fi
    echo
    echo "## Benchmarks (\`bench/test_gpu_bench.py\`)"
    echo
    echo "- decode attention: ${STATUS[kernel-bench]}${SECS[kernel-bench]:+, ${SECS[kernel-bench]}s}"
    echo "- end to end: ${STATUS[e2e-bench]}${SECS[e2e-bench]:+, ${SECS[e2e-bench]}s}"
    echo
    if [[ -n "$PY" ]]; then
        "$PY" -m bench.test_gpu_bench report "$RESULTS" 2>&1
    fi
    echo
    echo "Logs: gpu-logs/ (one per phase); raw figures: gpu-bench.jsonl."
} >"$REPORT"

log "report: $REPORT"
cat "$REPORT"
((tests_ok)) && exit 0
exit 1
