"""The offline API in vLLM's shape: `k3.LLM(model=DIR).generate(prompts, sampling_params)`."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from .engine import EngineConfig, LLMEngine
from .params import SamplingParams
from .request import RequestOutput

PromptType = str | dict[str, Any]


class LLM:
    """Generate for many prompts at once with continuous batching.

    model: checkpoint directory; platform: force a platform (default: detection);
    dtype: "auto" (the checkpoint's), "bfloat16", "float32" or "float64";
    tensor_parallel_size, data_parallel_size: TP ranks per DP rank and DP ranks, one process
    each; the caller is global rank 0 and launches the others (k3.engine.distributed; idle
    ranks wait at most distributed_timeout seconds, default 600, for the next step). Other
    EngineConfig fields as keywords.
    """

    def __init__(self, model: str, *, platform: str | None = None, dtype: str | None = "auto",
                 tensor_parallel_size: int = 1, data_parallel_size: int = 1, **engine_options):
        config = EngineConfig(model=str(model), platform=platform, dtype=dtype,
                              tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size,
                              **engine_options)
        if tensor_parallel_size * data_parallel_size > 1:
            from .tensor_parallel import start_tensor_parallel

            self.engine = start_tensor_parallel(config)
        else:
            self.engine = LLMEngine(config)
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> dict:
        """Counters since start-up: requests and tokens, prefix caching (queries, hits, reused
        tokens, rows its checkpoints hold) and speculative decoding (verify steps, drafted and
        accepted tokens, mean acceptance length, acceptance per draft position; absent
        without speculation). The same figures `k3 serve` exports on /metrics."""
        e = self.engine
        return {**e.stats, **e.prefix_cache_stats(), **e.spec_stats()}

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in prompt order. A prompt is a string or {"prompt_token_ids": [...]}, with
        optionally vLLM's "multi_modal_data": {"image": image or list} (tensors [3, H, W] or PIL
        images, one per media placeholder token of the prompt; k3.engine.media)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        for prompt, p in zip(prompts, params):
            request_id = f"llm-{self._counter}"
            self._counter += 1
            media = None
            if isinstance(prompt, dict):
                if "prompt_token_ids" not in prompt:
                    raise ValueError('a dict prompt needs "prompt_token_ids"')
                media = prompt.get("multi_modal_data")
                prompt = list(prompt["prompt_token_ids"])
            if media:
                self.engine.add_request(request_id, prompt, p or SamplingParams(), media)
            else:
                self.engine.add_request(request_id, prompt, p or SamplingParams())
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None, *,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """One or several conversations, rendered with the model's chat format. User messages may
        carry image_url parts (data: URLs and local files; k3.vision.media.load_image)."""
        from k3.chat.media import image_urls
        from k3.chat.template import chat_prompt_ids
        from k3.vision.media import MediaPolicy, load_image

        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            prompt = {"prompt_token_ids": chat_prompt_ids(self.engine.tokenizer, conv, tools=tools,
                                                          **(chat_template_kwargs or {}))}
            urls = image_urls(conv)
            if urls:
                policy = MediaPolicy(allow_local_files=True)
                prompt["multi_modal_data"] = {"image": [load_image(url, policy) for url in urls]}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm, file=sys.stderr) as bar:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in ids:
                        done[out.request_id] = out
                        bar.update(1)
                if not self.engine.has_unfinished_requests() and len(done) < len(ids):
                    raise RuntimeError("the engine stopped with requests unfinished")
        return [done[i] for i in ids]

    def shutdown(self) -> None:
        stop = getattr(self.engine, "shutdown", None)
        if stop:
            stop()
