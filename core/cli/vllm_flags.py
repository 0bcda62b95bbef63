"""vLLM's `vllm serve` flags as `k3 serve` takes them: the spellings k3 accepts with vLLM's
meaning, and the ones it refuses with a reason (instead of "unrecognized arguments").

`VLLM_SPELLINGS` names vLLM option strings that the `k3 serve` parser defines itself (a test
keeps them in step with the parser); `REFUSED` maps vLLM flags k3 does not implement to the
sentence `k3 serve` answers them with. `tools/vllm_flag_table.py` renders both, with the
parser's help, as the vLLM-to-k3 table in docs/serving.md.
"""

from __future__ import annotations

# vLLM spellings k3 serve accepts with vLLM's meaning (k3's help says where the meaning narrows)
VLLM_SPELLINGS = (
    "model_tag", "--model", "--served-model-name", "--host", "--port", "--api-key", "--uvicorn-log-level",
    "--enable-log-requests", "--disable-log-requests", "--max-log-len",
    "--dtype", "--quantization", "-q", "--load-format", "--seed", "--trust-remote-code", "--hf-overrides",
    "--generation-config", "--override-generation-config", "--revision", "--download-dir",
    "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--gpu-memory-utilization",
    "--kv-cache-dtype", "--block-size", "--enable-prefix-caching", "--no-enable-prefix-caching",
    "--tensor-parallel-size", "-tp", "--data-parallel-size", "-dp", "--enable-expert-parallel", "-ep",
    "--decode-context-parallel-size", "-dcp", "--nnodes", "--node-rank", "--master-addr", "--master-port",
    "--enforce-eager", "--cudagraph-capture-sizes", "--cuda-graph-sizes", "--async-scheduling",
    "--no-async-scheduling", "--speculative-config", "-sc", "--kv-transfer-config",
    "--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser", "--chat-template",
    "--allowed-local-media-path", "--limit-mm-per-prompt", "--mm-encoder-tp-mode", "--mm-processor-cache-gb",
    "--structured-outputs-config", "--guided-decoding-backend",
)

_PP = ("pipeline parallelism is not implemented: use --tensor-parallel-size, --data-parallel-size, "
       "--enable-expert-parallel")
_COMPILE = "k3 captures decode graphs itself: use --cudagraph-capture-sizes or --enforce-eager"

# vLLM flags k3 serve refuses, and why
REFUSED = {
    "--pipeline-parallel-size": _PP,
    "-pp": _PP,
    "--data-parallel-size-local": "k3 spreads the DP x TP ranks evenly over --nnodes: give --nnodes and --node-rank",
    "--data-parallel-address": "use --master-addr (node 0's address)",
    "--data-parallel-rpc-port": "use --master-port",
    "--distributed-executor-backend": "k3 starts one process per rank itself (or joins torchrun)",
    "--tokenizer": "k3 reads the tokenizer from the checkpoint directory",
    "--compilation-config": _COMPILE,
    "-cc": _COMPILE,
    "--cpu-offload-gb": "weight offloading is not implemented",
}
