#!/usr/bin/env bash
# GPU check: every `gpu`-marked test, then the benchmarks; prints a short summary last.
# Full results and the log go to $OUT (the device tool's output folder) or /tmp/flashdec_gpu.
#
#   GPU_CHECK_PHASES="tests engine eager e2e" bash scripts/gpu_check.sh
#   phases: tests (or its parts tests1, tests2, tests3: one device call each) quicktests tune tunefp8 decode decodequick decodefp8 decode25 window append engine eager
#   launch e2e extendtests extend extendsweep http mixed steps serve prefix hosttier hosttests spec
#   gemm
#   extra arguments per phase: TUNE_ARGS, DECODE_ARGS (decode, decodequick), FP8_ARGS,
#   WINDOW_ARGS, APPEND_ARGS, ENGINE_ARGS, EAGER_ARGS, LAUNCH_ARGS, E2E_ARGS, EXTEND_ARGS
#   (extend, extendsweep), GEMM_ARGS
#   gemm: the decode step's GEMMs (cuBLAS via F.linear) against the copy bandwidth at M = 1, 8,
#     64 (~1 min, gemm.md; issue 25); GEMM_ARGS="--gemv --sweep --batch 1 4" adds FlashDec's
#     small-batch GEMV and its launch sweep (~2 min);
#   window: sliding-window decode time, bytes and blocks held, L = W..32W (~1.5 min,
#     window_groups.md);
#   decodequick: the review method on every class of the decode matrix (~4 min, decode.md);
#   decodefp8: FP8 e4m3 KV against bf16 and FlashInfer's FP8 decode (~3 min, decode_fp8.md);
#   decode25: every row of issue 25's kernel table, FP8 beside bf16 (~5 min, decode_issue25.md);
#   tune: the launch-parameter sweep on issue 10's weak shapes (<= 4 min, decode_tuning.md);
#   tunefp8: the same sweep over FP8 KV (<= 4 min, decode_tuning_fp8.md)
#   extendtests: the extend kernel's tests only (tests/kernels/test_extend.py, CPU cases too);
#   extend: extend attention vs FlashInfer's best prefill path, issue 20's matrix (<= 8 min
#     budget, extend.md); extendsweep: its launch-configuration sweep (extend_sweep.md)
#   mixed: a mixed step's eager wall time against its GPU busy time (~2 min, mixed_step.md;
#     MIXED_ARGS="--host-profile 16 64" adds its host profile);
#   steps: every step of a saturated serving pass, wall vs GPU busy and idle (step_profile.md;
#     STEPS_ARGS="--rate 64 --max-num-batched-tokens 4096");
#   http: the HTTP layer's cost (bench_http.py; the server wheels carried in .whl); serve:
#     serve_trace.py's method at 4/16/64 req/s (serve.md; SERVE_ARGS="--vllm-json F" adds vLLM);
#     prefix: caching on vs off (prefix_cache.md; PREFIX_ARGS="--vllm-json F" adds vLLM's rows
#     and the issue-22 verdicts: F from `python3 benchmarks/vllm_prefix.py --json F` after vLLM's
#     install.sh, same trace flags; the window model: --model mistral-7b-window-shape --system 6144);
#     hosttier: the prefix cache's host tier on/off on a multi-turn chat 4x the GPU pool
#     (host_tier.md; HOST_ARGS="--vllm-json F" adds vLLM's rows: F from
#     `python3 benchmarks/vllm_host_tier.py --json F` after vLLM's install.sh); hosttests: its
#     GPU tests alone;
#     spec: issue 23: the verification step's cost, then speculation off vs ngram
#     (speculative.md; SPEC_ARGS="--real-model DIR --vllm-json F..." puts vLLM's ngram beside it:
#     DIR from benchmarks/export_real_model.py, F from benchmarks/vllm_speculative.py after vLLM's
#     install.sh; scripts/gpu_spec_lease.sh runs the whole lease in six device calls)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashdec_gpu}
mkdir -p "$OUT"
PHASES=${GPU_CHECK_PHASES:-tests engine eager e2e}
export PYTHONUNBUFFERED=1
LOG="$OUT/log.txt"
: >"$LOG"

# FlashInfer wheels (peer for the benchmarks), when carried in .whl/
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-} FLASHINFER_CUDA_ARCH_LIST=9.0
fi
export PYTHONPATH=.:${PYTHONPATH:-}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv 2>&1 | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  2>&1 | tee -a "$LOG"

# pytest-xdist workers (Triton builds and warm starts run on the host's cores); flashdec.LLM's
# tests use tiny models, whose pools are sized by max_batch_size x max_model_len: few workers
workers() {
  python3 -c "import xdist" 2>/dev/null && echo "-n ${GPU_TEST_WORKERS:-$1}"
}

status=0
for phase in $PHASES; do
  start=$(date +%s)
  echo "=== phase $phase ===" | tee -a "$LOG"
  case $phase in
    tests)  # under pytest-xdist one device call holds it (about 5 minutes with 8 workers);
      # the Llama-3-8B-shape model tests run after, alone: beside seven other workers they ran
      # out of memory on an 80 GB H100
      python3 -m pytest -m gpu tests -q -p no:cacheprovider --durations=15 $(workers 8) \
        --ignore=tests/models/test_gpu.py 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]}
      python3 -m pytest -m gpu tests/models/test_gpu.py -q -p no:cacheprovider 2>&1 \
        | tee -a "$LOG"
      [ "${PIPESTATUS[0]}" -ne 0 ] && rc=1 ;;
    tests1)  # the whole gpu suite takes over one device call's 10 minutes: three parts
      python3 -m pytest -m gpu tests/kernels tests/reference -q -p no:cacheprovider \
        --durations=15 $(workers 8) 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    tests2)  # the rest but flashdec.LLM's and the server's tests (tests3)
      python3 -m pytest -m gpu tests -q -p no:cacheprovider --durations=15 $(workers 4) \
        --ignore=tests/kernels --ignore=tests/reference --ignore=tests/server \
        --ignore-glob='tests/test_llm*.py' 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    tests3)  # every LLM here captures its graphs first (the warm start): a call of its own
      python3 -m pytest -m gpu tests/server tests/test_llm*.py -q -p no:cacheprovider \
        --durations=15 $(workers 3) 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    quicktests)
      python3 -m pytest tests/kernels -x -q -p no:cacheprovider -k "not TestErrors" 2>&1 \
        | tail -5 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    tune)
      python3 benchmarks/tune_decode.py --out-dir "$OUT" ${TUNE_ARGS:-} 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    decode)
      python3 benchmarks/bench_decode.py --out-dir "$OUT" ${DECODE_ARGS:-} 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    tunefp8)
      python3 benchmarks/tune_decode.py --fp8 --name decode_tuning_fp8 --out-dir "$OUT" \
        ${TUNE_ARGS:-} 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    decodequick)
      python3 benchmarks/bench_decode.py --quick --out-dir "$OUT" ${DECODE_ARGS:-} 2>&1 \
        | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    decode25)
      python3 benchmarks/bench_decode.py --issue25 --fp8 --name decode_issue25 --out-dir "$OUT" \
        ${DECODE_ARGS:-} 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    decodefp8)
      python3 benchmarks/bench_decode.py --fp8 --name decode_fp8 --out-dir "$OUT" \
        --heads 32/8/128 28/4/128 16/8/256 32/1/128 --pages 16 --warmup 5 --rep 20 \
        --shapes "B=1 L=32768" "B=32 L=4096" "B=16 L=16384" "B=1024 L=17" \
        "ragged 48x1..12345" --budget-s 200 ${FP8_ARGS:-} 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    window)
      python3 benchmarks/bench_window_groups.py --out-dir "$OUT" ${WINDOW_ARGS:-} 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    engine)
      python3 benchmarks/run_multi_layer_engine.py --out-dir "$OUT" ${ENGINE_ARGS:-} 2>&1 \
        | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    append)
      python3 benchmarks/bench_append.py --out-dir "$OUT" ${APPEND_ARGS:-} 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    eager)
      python3 benchmarks/bench_eager.py --out-dir "$OUT" ${EAGER_ARGS:-} 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    gemm)
      python3 benchmarks/bench_gemm.py --out-dir "$OUT" ${GEMM_ARGS:-} 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    launch)
      python3 benchmarks/bench_launch.py --out-dir "$OUT" ${LAUNCH_ARGS:-} 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    extendtests)
      python3 -m pytest tests/kernels/test_extend.py tests/reference/test_extend_ref.py -q \
        -p no:cacheprovider 2>&1 | tail -15 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    extend)
      python3 benchmarks/bench_extend.py --out-dir "$OUT" ${EXTEND_ARGS:-} 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    extendsweep)
      python3 benchmarks/bench_extend.py --sweep --out-dir "$OUT" ${EXTEND_ARGS:-} 2>&1 \
        | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    e2e)
      python3 benchmarks/bench_e2e.py --out-dir "$OUT" ${E2E_ARGS:-} 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    http)  # needs the server wheels in .whl (fastapi, uvicorn, uvloop, httptools, aiohttp, deps)
      python3 benchmarks/bench_http.py --rate 4 16 64 --json "$OUT/bench_http.json" \
        ${HTTP_ARGS:-} 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    mixed)
      python3 benchmarks/bench_mixed_step.py --out-dir "$OUT" ${MIXED_ARGS:-} 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    steps)
      python3 benchmarks/profile_steps.py --out-dir "$OUT" ${STEPS_ARGS:-} 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    serve)
      python3 benchmarks/bench_serve.py --out-dir "$OUT" ${SERVE_ARGS:-} 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    prefix)
      python3 benchmarks/bench_prefix.py --out-dir "$OUT" ${PREFIX_ARGS:-} 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    hosttier)  # the prefix cache's host tier on a chat beyond the GPU pool (host_tier.md)
      python3 benchmarks/bench_host_tier.py --out-dir "$OUT" ${HOST_ARGS:-} 2>&1 | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    hosttests)  # the host tier's and preemption's GPU tests only
      python3 -m pytest -m gpu tests/cache/test_host_tier_gpu.py -q -p no:cacheprovider 2>&1 \
        | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    spec)
      python3 benchmarks/bench_speculative.py --out-dir "$OUT" ${SPEC_ARGS:-} 2>&1 \
        | tee -a "$LOG"
      rc=${PIPESTATUS[0]} ;;
    *) echo "unknown phase $phase"; rc=2 ;;
  esac
  echo "=== phase $phase: rc=$rc, $(( $(date +%s) - start )) s ===" | tee -a "$LOG"
  [ "$rc" -ne 0 ] && status=$rc
done

echo "=== summary ==="
grep -h "=== phase .*rc=" "$LOG"
[ -f "$OUT/decode.md" ] && sed -n '/^## Summary/,/^## All shapes/p' "$OUT/decode.md"
for f in decode decode_fp8; do
  [ -f "$OUT/$f.md" ] && grep -q "^## Targets" "$OUT/$f.md" \
    && { echo "--- $f.md"; sed -n '/^## Targets/,/^## Summary/p' "$OUT/$f.md"; }
done
[ -f "$OUT/extend.md" ] && { echo "--- extend.md"; sed -n '/^## Targets/,/^## All shapes/p' "$OUT/extend.md"; }
[ -f "$OUT/extend_sweep.md" ] && { echo "--- extend_sweep.md"; \
  sed -n '/^## Best configuration/,/^## Best per shape/p' "$OUT/extend_sweep.md"; }
for f in decode_tuning decode_tuning_fp8; do
  [ -f "$OUT/$f.md" ] && grep -q "^## Tiles" "$OUT/$f.md" \
    && { echo "--- $f.md"; sed -n '/^## Best configuration/,/^## Tiles/p' "$OUT/$f.md"; }
done
[ -f "$OUT/append.md" ] && grep "^| " "$OUT/append.md"
[ -f "$OUT/multi_layer_engine.md" ] && grep "^| \|target" "$OUT/multi_layer_engine.md"
[ -f "$OUT/window_groups.md" ] && grep "^- W=" "$OUT/window_groups.md"
[ -f "$OUT/e2e.md" ] && grep "^| \|target\|agreement\|Memory" "$OUT/e2e.md"
[ -f "$OUT/speculative.md" ] && { echo "--- speculative.md"; \
  sed -n '/^## Targets/,/^## Mechanism cost/p' "$OUT/speculative.md"; }
exit $status
