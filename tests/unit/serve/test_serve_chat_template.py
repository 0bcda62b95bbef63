"""`k3 serve --chat-template`: a Jinja template renders chat prompts instead of the model's own
format; its prompt is exactly the rendered text's tokens, a template that raises is a 400, and
the CLI refuses a template it cannot read or compile before anything loads."""

from __future__ import annotations

try:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx
import pytest

from k3.chat.jinja_template import JinjaChatTemplate, JinjaTemplateError
from k3.serve import build_app

from serve_support import MODEL, LiveServer

TEMPLATE = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system messages') }}{% endif %}"
            "[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def templated(engine):
    with LiveServer(build_app(engine, served_model_name=MODEL, chat_template=JinjaChatTemplate(TEMPLATE))) as live:
        yield live


def test_prompt_is_the_rendered_template(templated, engine):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "again"}]
    with httpx.Client(base_url=templated.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2,
                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        expected = "[user] hi\n[assistant] yo\n[user] again\n[assistant]"      # written out, not rendered by k3
        assert r.json()["usage"]["prompt_tokens"] == len(engine.tokenizer.encode(expected, allow_special=True))
        bad = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                   "messages": [{"role": "system", "content": "s"}]})
        assert bad.status_code == 400 and "no system messages" in bad.json()["error"]["message"]


def test_template_from_a_file_and_refusals(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert JinjaChatTemplate(str(path)).render([{"role": "user", "content": "a"}]) == "[user] a\n[assistant]"
    with pytest.raises(JinjaTemplateError, match="no such file"):
        JinjaChatTemplate(str(tmp_path / "missing.jinja"))
    with pytest.raises(JinjaTemplateError, match="line 1"):
        JinjaChatTemplate("{% for m in messages %}")


def test_images_are_refused_under_a_template(templated):
    """k3-tiny has a tower, but a --chat-template renders text only: an image part is a 400
    naming why, not an image silently dropped."""
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with httpx.Client(base_url=templated.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "what is it?"}, part]}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "images_not_supported" and "--chat-template" in error["message"]
