#!/usr/bin/env bash
# Structured outputs on the H200 (issue 29), one device call (about 6 minutes). From the
# repository root, with the wheels below in .whl (carry ".whl"):
#   bash bench/structured_h200.sh
# Each step runs bench/structured_output.py --validate on k3-tiny (bfloat16, nvidia platform):
# decode tokens/s with and without a JSON-schema constraint at B = 1 / 16 / 64, then the
# 200-request check (20 schemas x 10 seeds: valid with jsonschema and finished with "stop").
# A step whose check is not 200 of 200 is marked FAILED in the summary (correctness first).
#   xgrammar   xgrammar, the engine's default scheduling (asynchronous on the H200)
#   sync       xgrammar, --async-scheduling off (the path before the asynchronous change)
#   guidance   llguidance (--structured-outputs-config '{"backend": "guidance"}')
#   ngram      xgrammar under n-gram speculation, k = 3 (constrained requests drafted for,
#              verified against their grammar); spec counters per batch in the JSON
# ONLY="step ..." runs just those steps. Each step has its own time limit (the first 180 s, as
# it may compile the Triton kernels into a cold cache; then 120 s: 540 s in all, under the call's
# 10 minutes). A step cut off by its limit shows "exit 124": run the rest in a second call,
# e.g. ONLY="guidance ngram". -> $OUT/structured-<step>.json, $OUT/structured.log
#
# Wheels the image lacks (Python 3.12; fetch here with the device README's `pip download`
# line, ~11 MB): xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4
# pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 llguidance==1.9.1
# jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
set -uo pipefail
: "${OUT:=./structured-h200-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=$PWD/.triton-cache
log="$OUT/structured.log"
python3 -c "import torch; assert torch.cuda.is_available()" 2> /dev/null \
    || { echo "no CUDA device: this script is for the H200" | tee -a "$log"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
python3 -c "import xgrammar, llguidance, jsonschema" || { echo "a wheel is missing (see the list above)" | tee -a "$log"; exit 2; }

limit=180
step() {   # step NAME ARGS...: one bench run under its own limit
    local name=$1; shift
    [[ -n ${ONLY:-} && " $ONLY " != *" $name "* ]] && return 0
    echo "== $name: $*" | tee -a "$log"
    timeout $limit python3 bench/structured_output.py --dtype bfloat16 --validate --out "$OUT/structured-$name.json" "$@" \
        >> "$log" 2>&1
    echo "== $name exit $?" | tee -a "$log"
    limit=120
}

step xgrammar
step sync --async-scheduling off
step guidance --backend guidance
step ngram --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'

python3 - "$OUT" <<'PY' | tee -a "$log"
import json, sys
from pathlib import Path
for path in sorted(Path(sys.argv[1]).glob("structured-*.json")):
    r = json.loads(path.read_text())
    v = r.get("validate", {})
    ok = v.get("valid_and_stopped") == v.get("requests") == 200
    ratios = " / ".join(f"{row['ratio']:.2f}x" for row in r["rows"])
    print(f"{path.stem}: {'ok' if ok else 'FAILED'} {v.get('valid_and_stopped')}/{v.get('requests')} valid; "
          f"constrained/free at B = {' / '.join(str(row['batch']) for row in r['rows'])}: {ratios}; "
          f"async={r['async_scheduling']}")
PY
