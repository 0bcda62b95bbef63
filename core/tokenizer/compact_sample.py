"""The fixed text the compact vocabulary's 128 merges are learned from.

Changing a single character here changes the merges, and with them the ids of every tiny
checkpoint's tokenizer; `tests/unit/tokenizer/test_compact.py` pins a digest of the merges.
"""

SAMPLE = """\
The quick brown fox jumps over the lazy dog. The model reads the text, then it writes the
answer one token at a time. When the user asks a question, the assistant thinks first and
then gives the answer in the response. There is a tool that can read files and another that
can search the web; the assistant may call them and wait for their results.
It's the small things that matter: a cache that is reused, a kernel that is fast, a test that
is exact. We don't guess, we measure. They've said that the numbers will be ready tomorrow.

def encode(self, text: str) -> list[int]:
    \"\"\"Return the token ids of the text.\"\"\"
    ids = []
    for piece in self.split(text):
        if piece in self.cache:
            ids.extend(self.cache[piece])
        else:
            ids.extend(self.merge(piece))
    return ids

class Config:
    def __init__(self, hidden_size: int = 64, num_layers: int = 8) -> None:
        self.hidden_size = hidden_size
        self.num_layers = num_layers

for i in range(10):
    print(f"step {i}: loss = {1.0 / (i + 1):.4f}")
{"role": "user", "content": "What is the weather in Beijing today?"}
{"role": "assistant", "content": "It is sunny, 25 degrees."}

我们的模型可以理解中文，也可以写代码。今天的天气很好，我们一起去公园散步吧。
这个问题的答案是什么？请你一步一步地思考，然后给出最后的答案。
人工智能是计算机科学的一个分支，它的目标是让机器能够像人一样思考和学习。
我们在上海和北京都有团队，大家一起开发这个模型。
Emoji are text too: 😀 😃 😄 😁 🙂 🚀 ✨ ✅ ❤️ 👍 — and so are symbols like ≤ ≥ → ∑ √ °C.
"""
