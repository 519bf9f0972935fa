#!/usr/bin/env bash
# Before/after in one lease: a benchmark run over a base tree's flashdec, then this tree's, and
# FlashDec's time per row side by side (the JSON and Markdown of both runs go to $OUT).
#
#   here:   rm -rf .base && mkdir .base && git archive REV flashdec benchmarks/*.py \
#             | tar -x -C .base            (.base is in .git/info/exclude; carry it)
#   there:  AB_BASE=.base bash scripts/gpu_ab.sh decode "--fp8 --no-flashinfer ..." \
#             extend "--quick --no-flashinfer ..."
# Arguments: pairs of (benchmark name: benchmarks/bench_<name>.py, its arguments).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashdec_ab}
BASE=${AB_BASE:-.base}
mkdir -p "$OUT"
RUNS=$(mktemp -d)  # each run writes its .md/.json/.png here; the .md and .json go on to $OUT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-} FLASHINFER_CUDA_ARCH_LIST=9.0
fi
status=0
while [ $# -ge 2 ]; do
  bench=$1 args=$2
  shift 2
  for side in base head; do
    root=.
    [ $side = base ] && root=$BASE
    echo "=== $bench ($side: $root) ==="
    # eval: the arguments are one string of options, quoted labels included
    eval "PYTHONPATH=$root:\${PYTHONPATH:-} python3 $root/benchmarks/bench_$bench.py $args \
      --out-dir $RUNS --name ${bench}_$side" 2>&1 | tail -3 || status=1
    cp "$RUNS/${bench}_$side".{md,json} "$OUT"/ 2>/dev/null
  done
  python3 - "$OUT/${bench}_base.json" "$OUT/${bench}_head.json" <<'PY'
import json, math, sys
base, head = (json.load(open(p)) for p in sys.argv[1:3])
key = lambda r: (r.get("dtype"), r.get("heads"), r.get("page"), r["shape"])
before = {key(r): r for r in base["rows"]}
print("| heads | page | shape | base us | head us | head/base | FP8 base | FP8 head | FP8 h/b |")
print("|---|---|---|---|---|---|---|---|---|")
ratios = {"bf16": [], "fp8": []}
for r in head["rows"]:
    b = before.get(key(r))
    if not b or not r.get("fd_us") or not b.get("fd_us"):
        continue
    cells = [r["heads"], r.get("page"), r["shape"], f"{b['fd_us']:.1f}", f"{r['fd_us']:.1f}"]
    ratios["bf16"].append(r["fd_us"] / b["fd_us"])
    cells.append(f"{ratios['bf16'][-1]:.3f}")
    f, fb = (r.get("fp8") or {}).get("fd_us"), (b.get("fp8") or {}).get("fd_us")
    if f and fb:
        ratios["fp8"].append(f / fb)
        cells += [f"{fb:.1f}", f"{f:.1f}", f"{f / fb:.3f}"]
    else:
        cells += ["-", "-", "-"]
    print("| " + " | ".join(str(c) for c in cells) + " |")
for name, rs in ratios.items():
    if rs:
        g = math.exp(sum(map(math.log, rs)) / len(rs))
        print(f"{name}: head/base geomean {g:.3f}, best {min(rs):.3f}, worst {max(rs):.3f}, {len(rs)} rows")
PY
done
exit $status
