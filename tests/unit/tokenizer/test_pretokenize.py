"""The pre-tokenisation pattern and the long-run cutting."""

import pytest
import regex
from tokenizers import Regex, pre_tokenizers

from k3.tokenizer.pretokenize import MAX_RUN, PATTERN, split_for_encoding


def pieces(text):
    return regex.findall(PATTERN, text, flags=regex.V1)


@pytest.mark.parametrize("text,expected", [
    ("Hello world", ["Hello", " world"]),
    ("hello世界abc", ["hello", "世界", "abc"]),                 # Han never joins a Latin word
    ("It's THE end", ["It's", " THE", " end"]),
    ("CamelCase", ["Camel", "Case"]),
    ("1234567", ["123", "456", "7"]),
    ("f(x);\n\n  y", ["f", "(x", ");\n\n", " ", " y"]),
    ("a   b", ["a", "  ", " b"]),
    ("你好，世界。", ["你好", "，", "世界", "。"]),
])
def test_pattern_pieces(text, expected):
    assert pieces(text) == expected


def test_tokenizers_engine_splits_the_same():
    """Oniguruma (tokenizers) and the reference split agree (tiktoken uses Rust's engine; the
    compact tests check it gives the same ids as tokenizers)."""
    text = "Hello World, it's 12345 ÉCOLE naïve 你好世界hello世界 😀 emoji\n\n  code(x)=>{return 1;}\r\n"
    split = pre_tokenizers.Split(Regex(PATTERN), behavior="isolated")
    assert [s for s, _ in split.pre_tokenize_str(text)] == pieces(text)


def test_split_for_encoding_cuts_only_long_runs():
    text = "word " * 10_000
    assert split_for_encoding(text) == [text]
    long = "a" * (2 * MAX_RUN + 7)
    assert [len(p) for p in split_for_encoding("x " + long + " y")] == [2 + MAX_RUN, MAX_RUN, 7 + 2]
    spaces = " " * (MAX_RUN + 1)
    assert "".join(split_for_encoding("a" + spaces + "b")) == "a" + spaces + "b"
    assert len(split_for_encoding("a" + spaces + "b")) == 2
