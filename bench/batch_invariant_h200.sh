#!/usr/bin/env bash
# Issue 31 on the H200 in one device call (step limits add up to under its 10 minutes; results
# under $OUT). From the repository root:
#   bash bench/batch_invariant_h200.sh
# Correctness first, then the cost:
#   1. conformance-bitwise: model.batch_invariance_bitwise on the nvidia platform, full tier
#      (k3-tiny and K3.1 Pro tiny, float32 and bfloat16), with the mode's kernels (the plugin's
#      invariant Triton kernels and the torch invariant set, platforms/nvidia/invariant.py):
#      logits bit-identical alone, in random batches with random chunks and a preemption, and in
#      a prefill recompute -> $OUT/conf_bi/report.json (every item "passed");
#   2. companions: the served log-probs of one sequence alone and beside 7 and 63 companions, and
#      its prefill recompute (bench/batch_invariant_companions.py, bf16) -> $OUT/companions.json
#      ("all_equal": true);
#   3. conformance-lora: the Triton LoRA kernels (lora_delta, lora_experts, served) on the
#      lora cases -> $OUT/conf_lora/report.json;
#   4. cost: TPOT, TTFT and throughput of the mode against the default mode (the served kernels,
#      CUDA graphs), same run, B = 1 / 8 / 64, bf16 (bench/batch_invariant.py) -> $OUT/cost.json.
# ONLY="step-name ..." runs just those steps.
set -uo pipefail
: "${OUT:=./h200-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=$PWD/.triton-cache
log="$OUT/session.log"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv >> "$log" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$log" 2>&1

source bench/device_steps.sh

step conformance-bitwise 170 python3 -m k3 conformance --platform nvidia --tier full -k batch_invariance_bitwise \
    --report "$OUT/conf_bi"
step companions 120 python3 bench/batch_invariant_companions.py --batches 1,8,64 --tokens 16 --dtype bfloat16 \
    --out "$OUT/companions.json"
step conformance-lora 90 python3 -m k3 conformance --platform nvidia --tier full -k "lora" --report "$OUT/conf_lora"
step cost 170 python3 bench/batch_invariant.py --batches 1,8,64 --prompt 64 --tokens 32 --dtype bfloat16 --repeats 3 \
    --out "$OUT/cost.json"
rm -f "$OUT/conf_bi/report.md" "$OUT/conf_lora/report.md"
grep -E '^::: |all_equal|tpot_ratio' "$log"
