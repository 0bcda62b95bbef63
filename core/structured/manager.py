"""StructuredOutputs: the compile cache and the per-request grammars of one engine.

Compiling runs on a small worker pool with a time limit (`compile_timeout_s`), so a
pathological schema costs its caller at most that long and never the engine loop: the server
compiles in its request handler (a thread-pool call) before the request reaches the engine,
and the engine then finds the grammar in the cache. A spec that fails (or times out) is
remembered as failing, so a repeat is refused at once. The cache holds `cache_size` grammars,
least recently used out first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from .backend import GrammarBackend, VocabInfo, make_backend
from .errors import StructuredOutputError
from .program import Constrained, Forced, walk_specs
from .request_state import RequestGrammar
from .spec import StructuredOutputsParams


class StructuredOutputs:
    """tokenizer: the engine's (its regular ids' bytes form the grammar vocabulary);
    vocab_size: the logits' width; stop_token_ids: ids that end a request; backend: a
    registered backend name (`k3.structured.backend`)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, *, backend: str = "xgrammar",
                 compile_timeout_s: float = 10.0, cache_size: int = 256, workers: int = 2):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.backend_name, self.compile_timeout_s, self.cache_size = backend, compile_timeout_s, cache_size
        self._backend: GrammarBackend | None = None
        self._cache: OrderedDict[tuple, object] = OrderedDict()      # key -> compiled or StructuredOutputError
        self._pending: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="k3-grammar")
        self.stats = {"compiles": 0, "cache_hits": 0, "failures": 0, "timeouts": 0}

    @property
    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                if self.tokenizer is None:
                    raise StructuredOutputError("structured outputs need a tokenizer (skip_tokenizer_init is set)")
                self.vocab = VocabInfo.from_tokenizer(self.tokenizer, self.vocab_size, self.stop_token_ids)
                self._backend = make_backend(self.backend_name, self.vocab)
            return self._backend

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of `spec` (cached); StructuredOutputError when it cannot be
        compiled or compiling takes longer than compile_timeout_s."""
        backend = self.backend
        if spec.sequence is not None:
            return [self.compile(s) for s in walk_specs(spec.sequence)]
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.stats["cache_hits"] += 1
                hit = self._cache[key]
                if isinstance(hit, StructuredOutputError):
                    raise hit
                return hit
            future = self._pending.get(key)
            if future is None:
                future = self._pool.submit(backend.compile, spec)
                self._pending[key] = future
                self.stats["compiles"] += 1
        try:
            result = future.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            result = StructuredOutputError(f"compiling the {spec.kind} constraint took longer than "
                                           f"{self.compile_timeout_s:g} s", field=spec.kind)
            self.stats["timeouts"] += 1
        except StructuredOutputError as e:
            result = e
            self.stats["failures"] += 1
        with self._lock:
            self._pending.pop(key, None)
            self._cache[key] = result
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        if isinstance(result, StructuredOutputError):
            raise result
        return result

    def request_grammar(self, spec: StructuredOutputsParams) -> RequestGrammar:
        """A fresh per-request state for `spec` (compiling it unless cached)."""
        self.compile(spec)
        core = list(spec.sequence) if spec.sequence is not None else [Constrained(spec)]
        segments = [Forced(spec.prefix), *core, Forced(spec.suffix)]
        backend = self.backend
        return RequestGrammar(segments, spec.trigger, self.stop_token_ids,
                              lambda s: backend.matcher(self.compile(s)), self.vocab.encoded_vocab)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
