"""A checkpoint whose tokenizer has no K3 / K2 chat markers (a sentencepiece-style Unigram
tokenizer.json, wrapped whole): it loads, serves completions, answers chat with a 400 naming
the missing markers, and keeps serving afterwards."""

from __future__ import annotations

import json
import shutil

try:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx
import openai
import pytest
from tokenizers import Tokenizer as HFCore, decoders, models, pre_tokenizers, trainers

from k3.engine.async_engine import AsyncEngine
from k3.engine.engine import EngineConfig, LLMEngine
from k3.serve import build_app
from k3.tokenizer.hf_wrapped import WrappedHFTokenizer

from serve_support import LiveServer, wait_rows_free

CORPUS = ["hello world, the model thinks", "the quick brown fox jumps over the lazy dog"] * 20


def write_unigram_tokenizer(model_dir, vocab_size: int) -> None:
    """A Llama-2-style sentencepiece tokenizer.json (Unigram, "▁" words, <0xNN> byte fallback)
    with <s> / </s> and filler added tokens up to `vocab_size` ids, so every id the model can
    sample decodes."""
    trained = HFCore(models.Unigram())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained.train_from_iterator(CORPUS, trainers.UnigramTrainer(vocab_size=100, special_tokens=["<unk>"],
                                                                unk_token="<unk>", show_progress=False))
    pieces = [tuple(p) for p in json.loads(trained.to_str())["model"]["vocab"]]
    vocab = pieces[:1] + [(f"<0x{b:02X}>", -100.0) for b in range(256)] + pieces[1:]
    core = HFCore(models.Unigram(vocab, 0, True))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    core.add_special_tokens(["<s>", "</s>"] + [f"<extra_{i}>" for i in range(vocab_size - len(vocab) - 2)])
    assert core.get_vocab_size() == vocab_size
    core.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


@pytest.fixture(scope="module")
def plain_engine(checkpoint, tmp_path_factory):
    """The session's k3-tiny weights with a Unigram tokenizer in place of the compact one."""
    d = tmp_path_factory.mktemp("k3-tiny-unigram")
    for f in checkpoint.iterdir():
        if f.name not in ("tiktoken.model", "tokenizer_config.json", "tokenizer.json"):
            shutil.copy(f, d / f.name)
    write_unigram_tokenizer(d, json.loads((d / "config.json").read_text())["text_config"]["vocab_size"])
    e = AsyncEngine(LLMEngine(EngineConfig(model=str(d), dtype="float32", kv_cache_memory_gib=0.02,
                                           max_model_len=512, load_progress=False)))
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def plain_server(plain_engine):
    with LiveServer(build_app(plain_engine, served_model_name="plain")) as live:
        yield live


def test_completions_serve_and_chat_is_a_400_naming_the_markers(plain_engine, plain_server):
    tok = plain_engine.tokenizer
    assert isinstance(tok, WrappedHFTokenizer) and tok.flavor is None
    client = openai.OpenAI(base_url=plain_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    first = client.completions.create(model="plain", prompt="hello world, the", max_tokens=6, temperature=0,
                                      logprobs=1)
    assert first.usage.prompt_tokens == len(tok.encode("hello world, the"))
    assert first.usage.completion_tokens == 6 and first.choices[0].finish_reason == "length"
    assert len(first.choices[0].logprobs.tokens) == 6

    with httpx.Client(base_url=plain_server.url, timeout=30) as http:
        for stream in (False, True):
            r = http.post("/v1/chat/completions", json={"model": "plain", "stream": stream, "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "chat_format_unavailable"
            assert error["param"] == "messages"
            message = error["message"]
            assert "no chat format" in message and "K3 XTML" in message and "K2" in message
            for marker in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<|im_user|>", "<|im_end|>"):
                assert marker in message, message
            assert "/v1/completions" in message
        assert http.get("/health").status_code == 200

    again = client.completions.create(model="plain", prompt="hello world, the", max_tokens=6, temperature=0,
                                      logprobs=1)
    assert again.choices[0].text == first.choices[0].text                 # still serving, same greedy text
    stream = "".join(c.choices[0].text for c in client.completions.create(
        model="plain", prompt="the quick brown", max_tokens=5, temperature=0, stream=True))
    whole = client.completions.create(model="plain", prompt="the quick brown", max_tokens=5, temperature=0)
    assert stream == whole.choices[0].text
    stats = wait_rows_free(plain_engine)
    assert stats["cache_rows_free"] == stats["cache_rows"] and stats["running"] == 0


def test_k3_parsers_are_refused_without_a_chat_format(plain_engine):
    with pytest.raises(ValueError, match="has no chat format"):
        build_app(plain_engine, served_model_name="x", reasoning_parser="kimi_k3")
