"""Prefill/decode disaggregation: moving a request's packed cache rows between engines
(docs/disaggregation.md). `KVTransferConfig` is the `--kv-transfer-config` JSON,
`TransferBackend` the data plane (a TCP stand-in, Mooncake), `KVProducer` / `KVConsumer` the
engine's two roles."""
