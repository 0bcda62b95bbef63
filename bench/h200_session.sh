#!/usr/bin/env bash
# What the NVIDIA kernels issue needs from the H200, one device call a phase (each under the
# 10-minute limit; at most 8 files come back from $OUT). From the repository root, with `.whl`
# (fla-core, tqdm wheels) carried:
#   bash bench/h200_session.sh conformance                  (about 5 minutes)
#     the served set (kernels, CUDA-graph decode: model.graph_decode), the report for
#     conformance/reports/nvidia-h200/; then the other chunked KDA prefills on the kda.chunked
#     and model cases: k3's batched torch kernel without the Triton diagonal (the fallback
#     where Triton is missing) and fla-core's (experimental; k3's pinned launch configurations);
#   bash bench/h200_session.sh kernels
#     per-kernel benchmarks: AttnRes, MXFP4 experts (decode batches), KDA decode launch variants,
#     MLA (decode and prefill), the KDA verify recurrence, the DSA indexer decode / prefill
#     scores and top-k, and the router (logits and selection);
#   bash bench/h200_session.sh prefill
#     the prefill kernels: KDA chunked prefill (k3's Triton phases and their launch variants,
#     fla-core's wrapper and kernel, the reference) and the MXFP4 experts at 1K-8K tokens (tiles
#     and the dequant mode);
#   bash bench/h200_session.sh e2e
#     k3-slice end to end (bench/k3_slice.py) with the served kernels and fla-core's chunked KDA
#     prefill, then the peer; K3_SLICE_ARGS adds arguments (e.g. "--ttft 1024 8192 --peer ''"),
#     E2E_EXPERIMENTAL replaces the experimental kernels switched on (default kda_chunked; "" for
#     the served set alone);
#   bash bench/h200_session.sh profile
#     device time per kernel of a k3-slice decode step and of an 8K prefill (bench/k3_slice_profile.py),
#     the host-synchronisation census (bench/host_syncs.py) and the MoE dequant mode's kernels
#     (bench/moe_dequant_profile.py);
#   bash bench/h200_session.sh profile64                    (about 5 minutes)
#     issue 27: where a 64-request k3-slice decode step goes, kernel by kernel and by module
#     (31.6 ms a step on an H100 against a ~16.5 ms bytes floor; the MoE ~13.8 ms of it), and the
#     16-request step for the trend;
#   bash bench/h200_session.sh check                        (about 5 minutes)
#     after a change to the served path, in one call: the served conformance report, k3-slice
#     end to end (served kernels, synchronous and asynchronous scheduling), the decode profile
#     and an 8K prompt's prefill profile;
#   bash bench/h200_session.sh moe-grouped
#     the grouped MXFP4 gemv (issue 27): the MoE decode-batch sweep at 1-64 tokens (gemv, grouped
#     gemv, tensor-core tiles), the moe and model conformance cases with it switched on
#     (experimental moe_experts_grouped), and k3-slice decode at 1 / 4 / 16 / 64 requests with the
#     served set and with it (ONLY="k3-slice-served k3-slice-grouped" for the second half alone);
#   bash bench/h200_session.sh vision                       (about 5 minutes)
#     issue 30: image chat through the OpenAI client against `k3 serve` on the nvidia platform
#     (a random k3-tiny checkpoint with its tiny tower; bench/vision_serve_check.py exits 1 and
#     names the failed check otherwise), then TTFT with one 448 px and one 896 px image on
#     k3-slice with the full K3 tower (random weights drawn on the GPU) against the same prompt
#     without the image and a text prompt of the same length (bench/vision_ttft.py). Needs the
#     server's wheels in `.whl` (docs/vision.md lists them);
#   bash bench/h200_session.sh amd                          (about 5 minutes)
#     issue 25: the amd plugin's kernel tables with gfx942's and gfx950's launch options run on the
#     H200 against the reference (bench/amd_tables_cuda.py: the configurations' numerics, not AMD
#     code generation; then gfx950's tables under the model cases), and the IPC all-gather's
#     device path (CUDA IPC handles, peer memory,
#     flags) with two processes on the one GPU, checked exactly (bench/ipc_allgather.py);
#   bash bench/h200_session.sh company                     (about 9 minutes)
#     issue 32 item 1: the variants conformance family on the served kernels (correctness first),
#     then bench/company_probe.py on k3-slice (per MoE layer, the routing flips of a prompt alone vs
#     among 40 others, and its logit difference), then bench/bf16_batch_company.py: 20 greedy
#     prompts alone vs among 40 others in bf16 on the served kernels, k3-slice in the default and
#     the batch-invariant mode, then k3-tiny (the CPU CI test's model) plain, with prefix caching
#     and under n-gram speculation (the before figures, K3_LEGACY_ROUNDING=1, and float32 are in
#     BENCHMARKS.md's fifteenth session);
#   bash bench/h200_session.sh tune
#     fla-core's autotuned launch configurations at K3's dimensions, as one bundle to unpack into
#     platforms/triton_kernels/fla_configs/<GPU>/ (python3 -m k3.platforms.triton_kernels.fla_configs).
#   bash bench/h200_session.sh collectives                  (about 2 minutes; every GPU of the machine)
#     the NVIDIA plugin's symmetric-memory all-reduce and all-gather against NCCL
#     (bench/symm_mem_allreduce.py: answers checked first, exit 1 on a difference; with one GPU
#     an API check, with 2-8 the speed against NCCL), then the conformance collectives cases
#     through them (K3_NVIDIA_SYMM_MEM=1; skipped by `multi_device` with one GPU).
#   bash bench/h200_session.sh moe-bf16                     (about 8 minutes)
#     issue 27: the decode_bf16 MoE mode's in-kernel decode bit for bit (bench/moe_bf16_decode_check.py),
#     how fast the tiles' access pattern streams the expert weights (bench/moe_weight_stream.py), the
#     tiles at 16 / 32 / 64 tokens with their loads pipelined and in the loop (bench/moe_mxfp4.py), then
#     Nsight Compute's full set on the decode_bf16 and dot_scaled tiles at 16 and 64 tokens
#     (bench/moe_ncu.py; the report as text in moe_ncu.txt);
#   bash bench/h200_session.sh moe-tiled                    (about 5 minutes)
#     issue 27: the MoE tiles reading the tile-major copy of the experts (moe_mxfp4_layout.py) against the
#     checkpoint layout's at 1 / 16 / 32 / 64 tokens, the prefill tiles with their loads pipelined and in the
#     loop at 1K / 2K tokens (bench/moe_mxfp4.py), and Nsight Compute on the tiled decode_bf16 tile at 64;
#   bash bench/h200_session.sh moe-bf16-e2e                 (about 8 minutes)
#     issue 27: k3-slice decode at 1 / 16 / 64 requests with the served set (moe_experts_bf16 promoted, the
#     experts repacked tile-major) and with the previous one (K3_NVIDIA_DISABLE=moe_experts_bf16: the experts
#     in the checkpoint layout) on the same GPU; the conformance phase checks the served set;
#   bash bench/h200_session.sh kda-mma                      (about 7 minutes)
#     issue 27 item 2: bench/kda_prefill.py (phase 1's "mma" form and the recurrence writing o to its
#     rows against the served form, fla-core and the reference), then the kda.chunked and model
#     conformance cases with the experimental kda_chunked_mma;
#   bash bench/h200_session.sh kda-split                    (about 6 minutes)
#     issue 27: bench/kda_prefill.py with the split phases (kda_intra_split, kda_chunked_state) beside
#     the served and mma forms, then the kda.chunked and model cases with both phases split;
# MOE_ARGS adds arguments to the MoE benchmark (e.g. "--batch 1 16 1024 8192": prefill sizes too).
#   bash bench/h200_session.sh columns                      (about 8 minutes)
#     issue 27, a quick check of the served prefill and MoE: the kda.chunked and model cases, phase 1
#     with its diagonal blocks a column at a time (diag_columns, served since 2026-12-07) and as
#     [16, 16, slice] tensors, the served MoE at T = 1 / 16 / 64 against its floor, k3-slice decode
#     at 1 and 64 requests.
# ONLY="step-name ..." runs just those steps of the phase (e.g. ONLY="bench-mla" ... kernels).
# Each step has its own time limit so one slow step cannot take the rest down with it; the step
# limits of a phase add up to under the device's 10 minutes a call. Triton's cache lives in the
# (ignored) .triton-cache folder, which a warm machine keeps between calls.
set -uo pipefail
phase=${1:-kernels}
# The phases are the case labels below, read from this file, so a new phase cannot be left out
# of the check (profile64 was, once: the call ended at the usage line).
phases=$(sed -n '/^case \$phase in$/,/^esac$/s/^\([a-z0-9-]*\))$/\1/p' "${BASH_SOURCE[0]}")
if ! grep -qx -- "$phase" <<< "$phases"; then
    echo "usage: bash bench/h200_session.sh $(tr '\n' '|' <<< "$phases" | sed 's/|$//')" >&2
    exit 2
fi
: "${OUT:=./h200-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=$PWD/.triton-cache
log="$OUT/session.log"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >> "$log" 2>&1

source bench/device_steps.sh

case $phase in
conformance)
    step conformance-served 240 python3 -m k3 conformance --platform nvidia --report "$OUT/conf"
    step conformance-kda-torch 150 env K3_NVIDIA_DISABLE=kda_chunked_blocked \
        python3 -m k3 conformance --platform nvidia --report "$OUT/conf_kda_torch" -k "kda.chunked or model"
    step conformance-fla 200 env K3_NVIDIA_EXPERIMENTAL=kda_chunked \
        python3 -m k3 conformance --platform nvidia --report "$OUT/conf_fla" -k "kda.chunked or model"
    rm -f "$OUT/conf_fla/report.md" "$OUT/conf_kda_torch/report.md"
    ;;
kernels)
    step bench-attn-res 45 python3 bench/attn_res.py --out "$OUT/attn_res.json"
    # shellcheck disable=SC2086
    step bench-moe 170 python3 bench/moe_mxfp4.py --out "$OUT/moe_mxfp4.json" ${MOE_ARGS:-}
    step bench-kda-decode 100 python3 bench/kda_decode.py --out "$OUT/kda_decode.json" --batch 1 64 256 --layouts hkv
    step bench-mla 120 python3 bench/mla.py --out "$OUT/mla.json"
    step bench-kda-verify 60 python3 bench/kda_verify.py --out "$OUT/kda_verify.json"
    step bench-indexer 60 python3 bench/indexer_decode.py --out "$OUT/indexer_decode.json"
    step bench-router 40 python3 bench/router.py --out "$OUT/router.json"
    ;;
prefill)
    step bench-kda-prefill 160 python3 bench/kda_prefill.py --out "$OUT/kda_prefill.json"
    step bench-moe-prefill 200 python3 bench/moe_mxfp4.py --out "$OUT/moe_mxfp4_prefill.json" --batch 1024 2048 8192
    ;;
e2e)
    # shellcheck disable=SC2086
    step bench-k3-slice 330 env K3_NVIDIA_EXPERIMENTAL="${E2E_EXPERIMENTAL-kda_chunked}" \
        python3 bench/k3_slice.py --out "$OUT/k3_slice.json" ${K3_SLICE_ARGS:-}
    ;;
profile)
    # where a k3-slice decode step's device time goes, kernel by kernel (eager launches)
    step profile-k3-slice 240 python3 bench/k3_slice_profile.py --graph --out "$OUT/k3_slice_profile.json"
    # where an 8K prompt's prefill goes
    step profile-prefill 120 python3 bench/k3_slice_profile.py --prefill 8192 --out "$OUT/k3_slice_prefill_profile.json"
    # where decode steps wait for the device besides reading their tokens (sync and async scheduling)
    step host-syncs 90 python3 bench/host_syncs.py --out "$OUT/host_syncs.json"
    # where the MoE dequant mode's time goes at prefill sizes (1K and 8K tokens), kernel by kernel
    step profile-moe-dequant 90 python3 bench/moe_dequant_profile.py --out "$OUT/moe_dequant_profile.json"
    ;;
profile64)
    step profile-k3-slice-64 200 python3 bench/k3_slice_profile.py --concurrency 64 --steps 4 \
        --out "$OUT/k3_slice_profile_c64.json"
    step profile-k3-slice-16 150 python3 bench/k3_slice_profile.py --concurrency 16 --steps 4 \
        --out "$OUT/k3_slice_profile_c16.json"
    ;;
check)
    # one call (about 5 minutes) after changes to the served path: the served report, k3-slice
    # decode (synchronous and asynchronous scheduling) with TTFT 1K / 8K and the workload, the profile
    step conformance-served 240 python3 -m k3 conformance --platform nvidia --report "$OUT/conf"
    step bench-k3-slice 200 env K3_NVIDIA_EXPERIMENTAL="${E2E_EXPERIMENTAL-}" \
        python3 bench/k3_slice.py --out "$OUT/k3_slice.json" --peer= --ttft 1024 8192 ${K3_SLICE_ARGS:-}
    step profile-k3-slice 75 python3 bench/k3_slice_profile.py --graph --out "$OUT/k3_slice_profile.json"
    step profile-prefill 60 python3 bench/k3_slice_profile.py --prefill 8192 --out "$OUT/k3_slice_prefill_profile.json"
    ;;
moe-grouped)
    step bench-moe-grouped 300 python3 bench/moe_mxfp4.py --out "$OUT/moe_mxfp4_grouped.json" \
        --batch 1 2 4 8 16 32 64 --variants gemv_n32_k512_w4_u4_h4 gg ds_n128
    step conformance-moe-grouped 200 env K3_NVIDIA_EXPERIMENTAL=moe_experts_grouped \
        python3 -m k3 conformance --platform nvidia --report "$OUT/conf_moe_grouped" -k "moe or model"
    rm -f "$OUT/conf_moe_grouped/report.md"
    step k3-slice-served 280 env K3_NVIDIA_EXPERIMENTAL= python3 bench/k3_slice.py --out "$OUT/k3_slice_served.json" \
        --peer= --decode-only --concurrency 1 4 16 64 --ttft 1024
    step k3-slice-grouped 280 env K3_NVIDIA_EXPERIMENTAL=moe_experts_grouped python3 bench/k3_slice.py \
        --out "$OUT/k3_slice_grouped.json" --peer= --decode-only --concurrency 1 4 16 64 --ttft 1024
    ;;
moe-bf16)
    step decode-check 60 python3 bench/moe_bf16_decode_check.py --out "$OUT/moe_bf16_decode_check.json"
    step weight-stream 60 python3 bench/moe_weight_stream.py --out "$OUT/moe_weight_stream.json"
    step moe-tiles 200 python3 bench/moe_mxfp4.py --out "$OUT/moe_mxfp4.json" --batch 16 32 64 \
        --variants dbfold_ db_n128_k64_t16_w8_s3 ds_n128_k64_t16_w8 inloop_
    step ncu-moe 170 ncu --set full --profile-from-start off --kernel-name regex:'_gate_up_kernel|_down_kernel' \
        -f -o "$OUT/moe_ncu" python3 bench/moe_ncu.py --batch 16 64 --variants db ds
    [[ -f $OUT/moe_ncu.ncu-rep ]] && ncu -i "$OUT/moe_ncu.ncu-rep" --page details > "$OUT/moe_ncu.txt" 2>&1
    rm -f "$OUT"/*.ncu-rep
    ;;
moe-tiled)
    step moe-tiles 240 python3 bench/moe_mxfp4.py --out "$OUT/moe_mxfp4_tiled.json" --batch 1 16 32 64 \
        --variants tiled_ dbfold_n128_k64_t16_w8_s3 ds_n128_k64_t16_w8
    step moe-prefill 150 python3 bench/moe_mxfp4.py --out "$OUT/moe_mxfp4_prefill.json" --batch 1024 2048
    step ncu-moe-tiled 120 ncu --set full --profile-from-start off --kernel-name regex:'_gate_up_kernel|_down_kernel' \
        -f -o "$OUT/moe_ncu_tiled" python3 bench/moe_ncu.py --batch 64 --variants tdb
    [[ -f $OUT/moe_ncu_tiled.ncu-rep ]] && ncu -i "$OUT/moe_ncu_tiled.ncu-rep" --page details > "$OUT/moe_ncu_tiled.txt" 2>&1
    rm -f "$OUT"/*.ncu-rep
    ;;
moe-bf16-e2e)
    step k3-slice-served 290 python3 bench/k3_slice.py --out "$OUT/k3_slice_served.json" --peer= --decode-only \
        --concurrency 1 16 64
    step k3-slice-before 290 env K3_NVIDIA_DISABLE=moe_experts_bf16 python3 bench/k3_slice.py \
        --out "$OUT/k3_slice_before.json" --peer= --decode-only --concurrency 1 16 64
    ;;
kda-mma)
    step bench-kda-prefill 200 python3 bench/kda_prefill.py --out "$OUT/kda_prefill.json"
    step conformance-kda-mma 240 env K3_NVIDIA_EXPERIMENTAL=kda_chunked_mma \
        python3 -m k3 conformance --platform nvidia --report "$OUT/conf_kda_mma" -k "kda.chunked or model"
    rm -f "$OUT/conf_kda_mma/report.md"
    ;;
kda-split)
    # the split phases (issue 27 item 2): every prefill form timed and checked, then the chunked
    # KDA and model conformance cases with both phases split (kda_chunked_splits)
    step bench-kda-prefill 300 python3 bench/kda_prefill.py --out "$OUT/kda_prefill.json"
    step conformance-kda-splits 240 env K3_NVIDIA_EXPERIMENTAL=kda_chunked_splits \
        python3 -m k3 conformance --platform nvidia --report "$OUT/conf_kda_splits" -k "kda.chunked or model"
    rm -f "$OUT/conf_kda_splits/report.md"
    ;;
columns)
    step conformance-kda-columns 180 python3 -m k3 conformance --platform nvidia --report "$OUT/conf_kda_columns" \
        -k "kda.chunked or model"
    rm -f "$OUT/conf_kda_columns/report.md"
    step kda-prefill-columns 80 python3 bench/kda_prefill_ncu.py --forms blocks blocks_columns split split_columns
    step moe-served 120 python3 bench/moe_mxfp4.py --out "$OUT/moe_served.json" --batch 1 16 64 --variants served-only
    step k3-slice-decode 190 python3 bench/k3_slice.py --out "$OUT/k3_slice.json" --peer= --decode-only \
        --concurrency 1 64
    ;;
vision)
    step vision-serve 180 python3 bench/vision_serve_check.py --platform nvidia --dtype bfloat16 \
        --out "$OUT/vision_serve-h200.json"
    step vision-ttft-k3-slice 200 python3 bench/vision_ttft.py --preset k3-slice --platform nvidia --dtype bfloat16 \
        --side 448 --repeats 5 --out "$OUT/vision_ttft-k3slice-448-h200.json"
    step vision-ttft-k3-slice-896 150 python3 bench/vision_ttft.py --preset k3-slice --platform nvidia \
        --dtype bfloat16 --side 896 --repeats 5 --out "$OUT/vision_ttft-k3slice-896-h200.json"
    ;;
collectives)
    gpus=$(nvidia-smi -L | wc -l)
    step symm-mem 240 python3 bench/symm_mem_allreduce.py --out "$OUT/symm-mem-h200x$gpus-$(date +%F).json"
    step conformance-collectives 240 env K3_NVIDIA_SYMM_MEM=1 \
        python3 -m k3 conformance --platform nvidia -k collectives --report "$OUT/conf_collectives"
    rm -f "$OUT/conf_collectives/report.md"
    ;;
amd)
    step amd-tables-gfx942 150 python3 bench/amd_tables_cuda.py --arch gfx942 --out "$OUT/amd_tables_gfx942.json"
    step amd-tables-gfx950 150 python3 bench/amd_tables_cuda.py --arch gfx950 --out "$OUT/amd_tables_gfx950.json"
    step amd-tables-models 180 python3 bench/amd_tables_cuda.py --arch gfx950 --models --out "$OUT/amd_tables_models.json"
    step ipc-allgather 60 python3 bench/ipc_allgather.py --ranks-per-gpu 2 --out "$OUT/ipc_allgather.json"
    ;;
company)
    step conformance-variants 130 python3 -m k3 conformance --platform nvidia --report "$OUT/conf_variants" \
        -k "variants"
    rm -f "$OUT/conf_variants/report.md"
    # where a crowd parts a prompt's computation: routing flips or a kernel variant (bench/company_probe.py)
    step company-probe 100 python3 bench/company_probe.py --prompts 3 --others 40 --steps 6 \
        --out "$OUT/company_probe.json"
    # k3-slice in bf16 with the served kernels: the default mode, and the exact mode (0 splits expected)
    step company-slice 240 python3 bench/bf16_batch_company.py --out "$OUT/bf16_batch_company.json" \
        --rounding after --dtypes bfloat16 --kernels served --settings plain batch_invariant
    # k3-tiny on the nvidia kernels: the CPU CI test's model (tests/unit/engine/test_bf16_batch_company.py)
    step company-tiny 90 python3 bench/bf16_batch_company.py --out "$OUT/bf16_batch_company_tiny.json" \
        --preset k3-tiny --rounding after --dtypes bfloat16 --kernels served --settings plain prefix_caching ngram
    ;;
tune)
    # the bundle is rewritten after each shape, so a cut-short run keeps the dtypes it finished
    step tune-fla 300 python3 -m k3.platforms.triton_kernels.fla_configs --out "$OUT/fla_configs.json"
    ;;
esac
grep -E "^:::|passed|failed|Error" "$log" | tail -20
