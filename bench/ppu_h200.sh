#!/usr/bin/env bash
# The ppu platform (issue 26) on the H200 as the CUDA-compatible stand-in for a PPU, one device
# call a phase (each under the 10-minute limit). From the repository root:
#   bash bench/ppu_h200.sh conformance     (k3 conformance --platform ppu, forced on cuda: the
#                                           compiled entries and model.graph_decode run there)
#     -> $OUT/ppu-h200/report.json, report.md: commit as conformance/reports/ppu-h200/
#   bash bench/ppu_h200.sh bench           (bench/ppu_backend.py: about 6 minutes, progress on stderr)
#     -> $OUT/ppu_backend-h200.json: bench/results/, rows in BENCHMARKS.md
# PPU_BENCH_ARGS adds arguments to the bench (e.g. "--no-compile", "--compile-step",
# "--variants ppu nvidia"). The bench stops starting phases after --budget-s (330 s).
set -uo pipefail
phase=${1:-}
: "${OUT:=./ppu-h200-out}"
mkdir -p "$OUT"
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
*)
    echo "usage: bash bench/ppu_h200.sh conformance|bench" >&2
    exit 2
    ;;
esac
