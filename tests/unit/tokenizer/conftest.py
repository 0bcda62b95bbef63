"""Shared tokenizers: the built-in compact ones and the same vocabularies loaded from files."""

import pytest

from k3.tokenizer import compact_tokenizer, load_tokenizer, write_compact_tokenizer


@pytest.fixture(scope="session")
def compact_dirs(tmp_path_factory):
    """flavor -> a directory holding the written compact tokenizer of that flavor."""
    dirs = {}
    for flavor in ("k3", "k2"):
        d = tmp_path_factory.mktemp(f"compact-{flavor}")
        write_compact_tokenizer(d, flavor=flavor)
        dirs[flavor] = d
    return dirs


@pytest.fixture(scope="session")
def all_tokenizers(compact_dirs):
    """Every source of the compact vocabulary: built-in (k3, k2), tiktoken files (k3),
    tokenizer.json (k2)."""
    return {
        "builtin-k3": compact_tokenizer("k3"),
        "builtin-k2": compact_tokenizer("k2"),
        "tiktoken-k3": load_tokenizer(compact_dirs["k3"]),
        "hf-k2": load_tokenizer(compact_dirs["k2"]),
    }


@pytest.fixture(params=["builtin-k3", "builtin-k2", "tiktoken-k3", "hf-k2"])
def tok(request, all_tokenizers):
    return all_tokenizers[request.param]
