"""A finished request and its reply, as the sample the sidecar trains on.

The proxy sends conversations, not token ids: the sidecar tokenises a ``messages`` row with the
verifier's own chat template (what vLLM rendered for the request) and puts the loss on the
assistant turns (``connector/contract/sample_tokens.py``), so the reply vLLM wrote is what the
draft learns, under the prompt it was written for. A chat request becomes
``{"messages": request messages + the reply, "tools": ...}`` (the reply's ``tool_calls`` too);
a completion becomes ``{"prompt": prompt + completion}`` (the sidecar trains a plain prompt on
every position, as vLLM's own extraction would see it). Only choice 0 of a request with ``n>1``
is taken: the others are replies to the same prompt.

What is not taken (counted, not guessed at): a reply that is not JSON or whose stream has an
error event, a token-id prompt (the text of the completion is not its token ids), ``echo``,
several prompts in one completion request, a chat without messages.

Everything here runs on the tee's thread, never on the proxy's event loop.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any


class NotTeed(ValueError):
    """The request or reply is not one the tee takes; the message is the counter's reason."""


@dataclass(frozen=True)
class TeeSample:
    """One sample for a traffic job: the REST row (without its id), the job options it needs
    (a chat request's ``chat_template_kwargs``), and its content hash (de-duplication, the
    held-out split, and the id the sidecar labels it with)."""

    row: dict
    options_key: str  # JSON of the chat_template_kwargs ("" for none): one traffic job per key
    digest: str
    #: What the request asked, without the reply (``messages`` [+ ``tools``], or ``prompt``): all
    #: the held-out slice keeps, and what the swap's gate prompts with.
    prompt: dict

    @property
    def label(self) -> str:
        return f"traffic-{self.digest[:24]}"

    def as_row(self) -> dict:
        return {"id": self.label, **self.row}


def _json(b: bytes) -> Any:  # noqa: ANN401
    try:
        return json.loads(b)
    except (ValueError, UnicodeDecodeError) as e:
        raise NotTeed("unparsable") from e


def sse_events(body: bytes) -> list[Any]:
    """The JSON payloads of a ``text/event-stream`` body (``data: {...}`` lines), ``[DONE]`` left
    out. An event that is not JSON, or an ``error`` event (vLLM reports a failure mid-stream
    that way, the status already sent as 200), refuses the whole reply."""
    out = []
    for line in body.splitlines():
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            continue
        ev = _json(data)
        if isinstance(ev, dict) and "error" in ev:
            raise NotTeed("error_in_stream")
        out.append(ev)
    return out


def _choice0(choices: Any) -> dict | None:  # noqa: ANN401
    if not isinstance(choices, list):
        return None
    for c in choices:
        if isinstance(c, dict) and c.get("index", 0) == 0:
            return c
    return None


def _merge_tool_calls(acc: dict[int, dict], deltas: Any) -> None:  # noqa: ANN401
    """OpenAI streams a tool call in pieces: its id and name once, its arguments in fragments."""
    if not isinstance(deltas, list):
        return
    for d in deltas:
        if not isinstance(d, dict):
            continue
        i = d.get("index", 0)
        call = acc.setdefault(i if isinstance(i, int) else 0, {"id": None, "type": "function",
                                                                 "function": {"name": "", "arguments": ""}})
        if d.get("id"):
            call["id"] = d["id"]
        if d.get("type"):
            call["type"] = d["type"]
        fn = d.get("function") or {}
        if isinstance(fn, dict):
            if fn.get("name"):
                call["function"]["name"] += str(fn["name"])
            if fn.get("arguments"):
                call["function"]["arguments"] += str(fn["arguments"])


def chat_reply(body: bytes, streamed: bool) -> dict:
    """The assistant message of choice 0 (``content``, ``tool_calls``, ``reasoning_content``)."""
    if not streamed:
        resp = _json(body)
        c = _choice0(resp.get("choices") if isinstance(resp, dict) else None)
        msg = c.get("message") if c else None
        if not isinstance(msg, dict):
            raise NotTeed("no_reply")
        out = {"role": "assistant", "content": msg.get("content")}
        if msg.get("tool_calls"):
            out["tool_calls"] = msg["tool_calls"]
        if msg.get("reasoning_content"):
            out["reasoning_content"] = msg["reasoning_content"]
        return out
    text: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict] = {}
    seen = False
    for ev in sse_events(body):
        c = _choice0(ev.get("choices") if isinstance(ev, dict) else None)
        if not c:
            continue
        seen = True
        d = c.get("delta") or {}
        if not isinstance(d, dict):
            continue
        if isinstance(d.get("content"), str):
            text.append(d["content"])
        rc = d.get("reasoning_content") or d.get("reasoning")
        if isinstance(rc, str):
            reasoning.append(rc)
        _merge_tool_calls(calls, d.get("tool_calls"))
    if not seen:
        raise NotTeed("no_reply")
    out: dict = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    return out


def completion_text(body: bytes, streamed: bool) -> str:
    if not streamed:
        resp = _json(body)
        c = _choice0(resp.get("choices") if isinstance(resp, dict) else None)
        if not c or not isinstance(c.get("text"), str):
            raise NotTeed("no_reply")
        return c["text"]
    parts, seen = [], False
    for ev in sse_events(body):
        c = _choice0(ev.get("choices") if isinstance(ev, dict) else None)
        if c is not None:
            seen = True
            if isinstance(c.get("text"), str):
                parts.append(c["text"])
    if not seen:
        raise NotTeed("no_reply")
    return "".join(parts)


def digest(row: dict, options_key: str) -> str:
    canon = json.dumps([row, options_key], sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(canon.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def build(route: str, request: bytes, reply: bytes) -> TeeSample:
    """The sample for a finished ``route`` request (``chat`` or ``completions``) with its 200
    reply; :class:`NotTeed` (its reason) when there is none to take."""
    req = _json(request)
    if not isinstance(req, dict):
        raise NotTeed("unparsable")
    streamed = bool(req.get("stream"))
    if route == "chat":
        msgs = req.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise NotTeed("no_messages")
        row: dict = {"messages": [*msgs, chat_reply(reply, streamed)]}
        prompt: dict = {"messages": msgs}
        if req.get("tools"):
            row["tools"] = prompt["tools"] = req["tools"]
        kw = req.get("chat_template_kwargs")
        key = json.dumps(kw, sort_keys=True) if isinstance(kw, dict) and kw else ""
    elif route == "completions":
        prompt = req.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise NotTeed("token_or_batched_prompt")
        if req.get("echo"):
            raise NotTeed("echo")
        row, key = {"prompt": prompt + completion_text(reply, streamed)}, ""
        prompt = {"prompt": prompt}  # type: ignore[assignment]
    else:
        raise NotTeed("route")
    if not row.get("prompt", True):
        raise NotTeed("empty")
    return TeeSample(row, key, digest(row, key), prompt)  # type: ignore[arg-type]
