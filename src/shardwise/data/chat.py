"""Chat / instruction data for ``shardwise prepare --chat``: JSONL conversations rendered
with a chat template, each token marked as a target (an assistant's) or not.

A record is ``{"messages": [{"role": ..., "content": ...}, ...]}`` or ``{"prompt": ...,
"response": ...}`` (a user turn and an assistant turn). The template is Jinja, rendered
through ``transformers``' template engine (``render_jinja_template``, the one
``apply_chat_template`` uses); it comes from a file or from the ``chat_template`` of the
``tokenizer_config.json`` beside the tokenizer. An assistant turn's characters are those
between the rendering of the turns before it with the generation prompt and the rendering
up to and including it (so its end-of-turn marker is a target, the prompt is not); a token
is a target when it starts inside such a span.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from shardwise.data.corpus import DataError


def load_template(tokenizer_file: str, template_file: str | None) -> str:
    """The template's text: ``template_file``, else ``chat_template`` of the
    ``tokenizer_config.json`` beside ``tokenizer_file`` (a string, or the entry named
    "default" of a list). ``DataError`` (one line) when neither gives one."""
    if template_file is not None:
        try:
            return Path(template_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"--chat-template {template_file}: {e}") from None
    cfg = Path(tokenizer_file).with_name("tokenizer_config.json")
    try:
        t = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        t = None
    if isinstance(t, list):
        t = next((d.get("template") for d in t if isinstance(d, dict)
                  and d.get("name") == "default"), None)
    if not isinstance(t, str) or not t:
        raise DataError(f"--chat: {cfg} gives no chat_template; pass --chat-template FILE")
    return t


def conversation(record, where: str) -> list[dict]:
    """A record's messages (``where``: file and line, for the one-line ``DataError``)."""
    if isinstance(record, dict) and "messages" in record:
        msgs = record["messages"]
        if not (isinstance(msgs, list) and msgs and all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in msgs)):
            raise DataError(f"{where}: messages must be a non-empty list of "
                            "{role: str, content: str}")
        return msgs
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) \
            and isinstance(record.get("response"), str):
        return [{"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["response"]}]
    raise DataError(f"{where}: expected a messages field, or prompt and response strings")


def render(messages: list[dict], template: str, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and the character spans ``[start, end)`` of its assistant
    turns. ``DataError`` when the template does not render earlier turns as a prefix."""
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        raise DataError("--chat: needs transformers and jinja2 (pip install "
                        "'shardwise[chat]')") from None

    def text(msgs, prompt: bool) -> str:
        try:
            out, _ = render_jinja_template([msgs], chat_template=template,
                                           add_generation_prompt=prompt)
        except Exception as e:  # noqa: BLE001 - a template error is the user's input
            raise DataError(f"{where}: the chat template fails: {e}") from None
        return out[0]

    whole = text(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, upto = text(messages[:i], True), text(messages[:i + 1], False)
        if not (upto.startswith(before) and whole.startswith(upto)):
            raise DataError(f"{where}: the chat template does not render the turns before "
                            "an assistant's as a prefix; the loss mask cannot be placed")
        spans.append((len(before), len(upto)))
    return whole, spans


def target_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 (N,): 1 for the tokens whose first character lies in a span."""
    starts = np.array([s for s, _ in offsets], dtype=np.int64)
    mask = np.zeros(len(offsets), dtype=np.uint8)
    for a, b in spans:
        mask[(starts >= a) & (starts < b)] = 1
    return mask
