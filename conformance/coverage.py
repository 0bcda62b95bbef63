"""Which conformance family covers each plugin hook. Every hookspec of `k3.plugin.hookspecs`
is either covered by a case family here or is a platform hook tested by the plugin tests
(tests/unit/plugin, tests/plugins); a meta-test keeps this list complete."""

HOOK_FAMILIES = {
    "k3_kda_kernels": "kda",
    "k3_mla_kernels": "mla",
    "k3_indexer_kernels": "indexer",
    "k3_moe_kernels": "moe",
    "k3_attn_res_kernels": "attn_res",
    "k3_elementwise_kernels": "elementwise",
    "k3_quant_kernels": "quant",
    "k3_lora_kernels": "lora",
    "k3_dense_kernels": "dense",
    "k3_collective_backends": "collectives",
    "k3_process_weights": "model",          # the model cases call Platform.process_weights
    "k3_allocate_cache": "model",           # the model cases run the platform on a packed CachePool
    "k3_kda_state_layout": "model",         # ... whose KDA state rows use the platform's layout
    "k3_graph_runner": "model",             # model.graph_decode: replayed decode equals eager decode
    "k3_step_end": "model",                 # every model case's runner cuts each step there
}

TESTED_ELSEWHERE = (
    "k3_detect_platform",
    "k3_capabilities",
    "k3_add_cli_options",
    "k3_config_defaults",
    "k3_validate_config",
    "k3_conformance_expectations",          # read by the conformance session; its format is tested here
    "k3_shape_buckets",                     # tests/unit/engine/test_static_shapes.py (padding isolation), tests/tpu
)
