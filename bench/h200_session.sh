#!/usr/bin/env bash
# What the NVIDIA kernels issue needs from the H200, in three device calls (each under the
# 10-minute limit; at most 8 files come back from $OUT). From the repository root, with `.whl`
# (fla-core, tqdm wheels) carried:
#   bash bench/h200_session.sh conformance
#     the served set (kernels, CUDA-graph decode: model.graph_decode), the report for
#     conformance/reports/nvidia-h200/; then the experimental MoE, AttnRes and MLA kernels
#     (K3_NVIDIA_EXPERIMENTAL), their cases and the whole-model cases only, so fla-core's
#     autotuning stays out of it;
#   bash bench/h200_session.sh kernels
#     benchmarks: MXFP4 experts, AttnRes, MLA (decode and prefill), KDA prefill (fla-core
#     wrapper), KDA decode launch variants;
#   bash bench/h200_session.sh e2e
#     k3-slice end to end (bench/k3_slice.py) with the experimental kernels, then the peer.
# Each step has its own time limit so one slow step cannot take the rest down with it.
set -uo pipefail
phase=${1:-kernels}
if [[ $phase != conformance && $phase != kernels && $phase != e2e ]]; then
    echo "usage: bash bench/h200_session.sh conformance|kernels|e2e" >&2
    exit 2
fi
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

case $phase in
conformance)
    step conformance-served 240 python3 -m k3 conformance --platform nvidia --report "$OUT/conf"
    step conformance-experimental 300 env K3_NVIDIA_EXPERIMENTAL=kda_short_conv,moe_experts,moe_router,attn_res_step,mla_decode,mla_prefill \
        python3 -m k3 conformance --platform nvidia --report "$OUT/conf_exp" -k "conv or moe or attn_res or mla or model or cache"
    rm -f "$OUT/conf_exp/report.md"
    ;;
kernels)
    step bench-moe 130 python3 bench/moe_mxfp4.py --out "$OUT/moe_mxfp4.json"
    step bench-attn-res 50 python3 bench/attn_res.py --out "$OUT/attn_res.json"
    step bench-mla 120 python3 bench/mla.py --out "$OUT/mla.json"
    step bench-kda-prefill 110 python3 bench/kda_prefill.py --out "$OUT/kda_prefill.json"
    step bench-kda-decode 150 python3 bench/kda_decode.py --out "$OUT/kda_decode.json" --batch 1 64 256 --layouts hkv
    ;;
e2e)
    step bench-k3-slice 540 env K3_NVIDIA_EXPERIMENTAL=kda_short_conv,moe_experts,moe_router,attn_res_step,mla_decode,mla_prefill \
        python3 bench/k3_slice.py --out "$OUT/k3_slice.json"
    ;;
esac
grep -E "^:::|passed|failed|Error" "$log" | tail -20
