"""Generation: the engine (factory, scheduler, runner, step strategies, outputs), the offline
LLM API, the asynchronous engine for the server, tensor parallelism and speculative decoding."""
