"""Prompt rendering: the tokenizer's chat template when it has one, else a format string.

The tokenizer is any object with the Hugging Face tokenizer interface (``chat_template``,
``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``, ``encode``,
``pad_token_id``, ``eos_token_id``); core never imports ``transformers``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["as_messages", "prompt_text", "has_chat_template", "render_prompt"]


def as_messages(prompt: str | Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    """A prompt as chat messages: a string becomes one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    messages = [dict(m) for m in prompt]
    if not messages or any("role" not in m or "content" not in m for m in messages):
        raise ValueError(
            f"prompt={prompt!r:.200} is invalid: a string or a list of {{'role', 'content'}} messages"
        )
    return messages


def prompt_text(prompt: str | Sequence[Mapping[str, str]]) -> str:
    """Plain text of a prompt: the string, or the last user message's content."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in as_messages(prompt) if m["role"] == "user"]
    return users[-1] if users else as_messages(prompt)[-1]["content"]


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "apply_chat_template")


def render_prompt(
    tokenizer: Any,
    prompt: str | Sequence[Mapping[str, str]],
    *,
    prompt_template: str = "{prompt}",
    use_chat_template: bool = True,
) -> tuple[str, bool]:
    """The text fed to the model and whether the chat template made it.

    With a chat template (and ``use_chat_template``) the messages are rendered with
    ``add_generation_prompt=True``; otherwise ``prompt_template.format(prompt=...)``.
    """
    if use_chat_template and has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(as_messages(prompt), tokenize=False, add_generation_prompt=True)
        return str(text), True
    try:
        return prompt_template.format(prompt=prompt_text(prompt)), False
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"dataset.prompt_template={prompt_template!r} is invalid: it may only use the placeholder "
            f"{{prompt}} (literal braces doubled: '{{{{'); error: {exc!r}"
        ) from exc
