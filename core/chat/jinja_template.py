"""A Jinja chat template given on the command line (vLLM's `--chat-template`).

k3 renders its models' own chat formats in code (`k3.chat.template`); `--chat-template` replaces
that with a Hugging Face-style Jinja template for the prompts of /v1/chat/completions. The
template sees `messages`, `tools`, `tool_choice`, `response_format`, `add_generation_prompt`,
`bos_token` / `eos_token` (empty strings) and the request's `chat_template_kwargs`, and may call
`raise_exception(message)`. It runs in Jinja's immutable sandbox. The rendered text is encoded
with special-token strings as special tokens, as Hugging Face's `apply_chat_template` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from .errors import ChatTemplateError


class JinjaTemplateError(ValueError):
    """The template could not be read or compiled (a startup error)."""


class JinjaChatTemplate:
    """A compiled chat template. `source`: a file path, else the template text itself (a
    string with a Jinja tag or expression in it)."""

    def __init__(self, source: str):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        path = Path(source)
        try:
            is_file = path.is_file()
        except OSError:          # a template too long to be a path
            is_file = False
        if is_file:
            text, self.origin = path.read_text(), str(path)
        elif "{{" in source or "{%" in source:
            text, self.origin = source, "the command line"
        else:
            raise JinjaTemplateError(f"{source}: no such file, and not a Jinja template (no {{{{ or {{% in it)")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(text)
        except jinja2.TemplateSyntaxError as e:
            raise JinjaTemplateError(f"chat template from {self.origin}: line {e.lineno}: {e.message}") from None

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools=None, tool_choice=None, response_format=None,
               add_generation_prompt: bool = True, **template_kwargs) -> str:
        """The prompt text; ChatTemplateError (a 400) when the template raises or fails."""
        import jinja2

        try:
            return self._template.render(messages=list(messages), tools=tools, tool_choice=tool_choice,
                                         response_format=response_format,
                                         add_generation_prompt=add_generation_prompt, bos_token="", eos_token="",
                                         **template_kwargs)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            raise ChatTemplateError(f"messages: the chat template failed: {e}") from None

    def prompt_ids(self, tokenizer, messages, **kwargs) -> list[int]:
        """Token ids of the rendered prompt (special-token strings as special tokens)."""
        return tokenizer.encode(self.render(messages, **kwargs), allow_special=True)


def _raise(message: str):
    raise ChatTemplateError(f"messages: {message}")
