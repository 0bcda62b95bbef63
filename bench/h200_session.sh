#!/usr/bin/env bash
# Everything the NVIDIA kernels issue needs from one H200 device call, results under $OUT
# (at most 8 files come back): run from the repository root as `bash bench/h200_session.sh`
# with `.whl` (fla-core, tqdm wheels) carried.
#   1. conformance of the served kernel set (report for conformance/reports/nvidia-h200/);
#   2. conformance of the experimental MoE and AttnRes kernels (K3_NVIDIA_EXPERIMENTAL), their
#      cases and the whole-model cases only, so fla-core's autotuning stays out of it;
#   3. the benchmarks: MXFP4 experts, AttnRes, KDA decode, KDA prefill.
# Each step has its own time limit so one slow step cannot take the rest down with it.
set -uo pipefail
: "${OUT:=./h200-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log="$OUT/session.log"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >> "$log" 2>&1

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "::: $name" | tee -a "$log"
    local start=$SECONDS
    timeout "$limit" "$@" >> "$log" 2>&1
    echo "::: $name exit $? after $((SECONDS - start)) s" | tee -a "$log"
}

step conformance-served 150 python3 -m k3 conformance --platform nvidia --report "$OUT/conf"
step conformance-experimental 150 env K3_NVIDIA_EXPERIMENTAL=moe_experts,attn_res_step \
    python3 -m k3 conformance --platform nvidia --report "$OUT/conf_exp" -k "moe or attn_res or model"
step bench-moe 150 python3 bench/moe_mxfp4.py --out "$OUT/moe_mxfp4.json"
step bench-attn-res 60 python3 bench/attn_res.py --out "$OUT/attn_res.json"
step bench-kda-decode 120 python3 bench/kda_decode.py --out "$OUT/kda_decode.json" --batch 1 64 256
grep -E "^:::|passed|failed" "$log" | tail -20
