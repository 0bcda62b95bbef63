#!/usr/bin/env bash
# The ppu platform (issue 26) on the H200 as the CUDA-compatible stand-in for a PPU, one device
# call a phase (each under the 10-minute limit). From the repository root:
#   bash bench/ppu_h200.sh conformance     (k3 conformance --platform ppu, forced on cuda: the
#                                           compiled entries and model.graph_decode run there)
#     -> $OUT/ppu-h200/report.json, report.md: commit as conformance/reports/ppu-h200/
#   bash bench/ppu_h200.sh bench           (bench/ppu_backend.py: the MoE microbenchmark, then the
#                                           ppu / nvidia / naive engines; about 7 minutes)
#     -> $OUT/ppu_backend-h200.json, bench.log: bench/results/, rows in BENCHMARKS.md
#   bash bench/ppu_h200.sh profile         (bench/ppu_profile.py: kernel times by name and by
#                                           module of decode steps at 1 and 64 requests and of
#                                           one 8K prefill, one ppu engine; about 3 minutes)
#     -> $OUT/ppu_profile-h200.json, profile.log
#   bash bench/ppu_h200.sh variants        (optional: ppu_eager (nothing compiled, what a PPU
#                                           runs), ppu_mxfp4 (expert cache off), reference_table)
#     -> $OUT/ppu_variants-h200.json, variants.log
#   bash bench/ppu_h200.sh widths          (the decode graphs' context bounds, A/B: the ppu engine
#                                           with the expert cache off (fits an H100) at 1 / 16 / 64 requests
#                                           with token bounds, then at the full width only, then nvidia;
#                                           three processes, about 5 minutes)
#     -> $OUT/ppu_widths-*.json, widths.log
#   bash bench/ppu_h200.sh dequant         (the compiled MXFP4 dequantisation's forms against the copy
#                                           bandwidth (bench/ppu_dequant.py), then the ppu engine with the
#                                           expert cache off at 1 / 16 requests and one 8K prompt, with the
#                                           served form and with the fastest if it is another
#                                           (K3_MXFP4_COMPILED_FORM); about 8 minutes)
#     -> $OUT/ppu_dequant-h200.json, ppu_dequant-engine-<form>-h200.json, dequant.log
# PPU_BENCH_ARGS / PPU_PROFILE_ARGS add arguments (e.g. "--compile-step", "--no-compile").
# The bench starts no phase after --budget-s (480 s) and rewrites its JSON after every phase.
set -uo pipefail
phase=${1:-}
: "${OUT:=./ppu-h200-out}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=$PWD/.triton-cache
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 2
case $phase in
conformance)
    timeout 560 python3 -m k3 conformance --platform ppu --tier full --report "$OUT/ppu-h200" \
        2>&1 | tail -40 | tee "$OUT/conformance.log"
    ;;
bench)
    # shellcheck disable=SC2086
    timeout 560 python3 bench/ppu_backend.py --out "$OUT/ppu_backend-h200.json" ${PPU_BENCH_ARGS:-} \
        2>&1 | tee "$OUT/bench.log" | grep -E '^\[|Error|error'
    ;;
profile)
    # shellcheck disable=SC2086
    timeout 560 python3 bench/ppu_profile.py --out "$OUT/ppu_profile-h200.json" ${PPU_PROFILE_ARGS:-} \
        2>&1 | tee "$OUT/profile.log" | grep -E '^==|^ +[0-9.]+ us|expert cache|Error|error' | head -150
    ;;
variants)
    # shellcheck disable=SC2086
    timeout 560 python3 bench/ppu_backend.py --no-moe --variants ppu_eager ppu_mxfp4 reference_table \
        --concurrency 1 16 64 --out "$OUT/ppu_variants-h200.json" ${PPU_BENCH_ARGS:-} \
        2>&1 | tee "$OUT/variants.log" | grep -E '^\[|Error|error'
    ;;
widths)
    for run in "narrow --variants ppu_mxfp4" "full --variants ppu_mxfp4 --full-width-graphs" "nvidia --variants nvidia"; do
        read -r name rest <<< "$run"
        # shellcheck disable=SC2086
        timeout 180 python3 bench/ppu_backend.py --no-moe $rest --concurrency 1 16 64 --ppu-memory-utilization 0.8 \
            --out "$OUT/ppu_widths-$name.json" ${PPU_BENCH_ARGS:-} 2>&1 | tee -a "$OUT/widths.log" | grep -E '^\[|Error|error'
    done
    ;;
dequant)
    (cd bench && timeout 200 python3 ppu_dequant.py --out "$OUT/ppu_dequant-h200.json") 2>&1 | grep -v Warning \
        | tee "$OUT/dequant.log"
    read -r served best < <(python3 -c "import json, sys; r = json.load(open(sys.argv[1]))
print(r['served_form'], r.get('fastest_form') or r['served_form'])" "$OUT/ppu_dequant-h200.json" 2>/dev/null \
        || echo table table)
    forms=$served; [ "$best" != "$served" ] && forms="$served $best"
    for form in $forms; do     # the served form, then the fastest if it is another
        # shellcheck disable=SC2086
        K3_MXFP4_COMPILED_FORM=$form timeout 170 python3 bench/ppu_backend.py --no-moe --variants ppu_mxfp4 \
            --concurrency 1 16 --decode-tokens 16 --ttft 8192 --out "$OUT/ppu_dequant-engine-$form-h200.json" \
            ${PPU_BENCH_ARGS:-} 2>&1 | sed "s/^\[/[$form /" | tee -a "$OUT/dequant.log" | grep -E '^\[|Error|error'
    done
    ;;
*)
    echo "usage: bash bench/ppu_h200.sh conformance|bench|profile|variants|widths|dequant" >&2
    exit 2
    ;;
esac
