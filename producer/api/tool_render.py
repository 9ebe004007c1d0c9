"""Tool calls in chat answers: read off the output, the message of a whole answer, the deltas of a
streamed one.

Calls are read as written (``read_calls``): a JSON call or an array of calls of known tools,
optionally inside ``<tool_call>`` tags; the same call twice is two calls. A choice whose text is
calls answers ``content: null`` with
``tool_calls`` and finish reason ``tool_calls``. One cut short by ``max_tokens`` keeps
``length``: a named call with its arguments as far as they got (as OpenAI answers), an array
with the calls it completed. A ``required`` answer that completed no call (cut short inside its
first) has empty content, as vLLM answers: its text is the grammar's JSON cut short, which no
client could parse; an ``auto`` answer that is no call is content as written.

Streamed, a named function's choice opens with the call (id, name, empty
arguments) and then streams its arguments as they are generated; a ``required`` choice is
held until it ends, then sent in one delta; an ``auto`` choice is held while it may be a call
(its first non-blank character opens JSON or a ``<tool_call>`` tag), else streamed as content.
"""

from __future__ import annotations

import json
import re
from typing import Any

from producer.api.openai_types import ChatMessageOut
from producer.api.tools import ToolCall, ToolPlan, call_id

CALL_OPENERS = ("[", "{", "<")  # how an auto answer that is a call can begin (JSON, or <tool_call>)
TOOL_CALL_TAGS = re.compile(r"^\s*<tool_call>\s*(.*?)\s*(</tool_call>)?\s*$", re.DOTALL)


def read_calls(plan: ToolPlan, text: str, is_cut: bool = False) -> list[ToolCall] | None:
    """The calls ``text`` makes, as written (None: it is not a call, so it is content); ``is_cut``:
    the output ended at max_tokens, and an array's complete calls are read (a named call's
    arguments are returned as they are, cut short, as OpenAI does)."""
    if plan.mode == "named":
        assert plan.named is not None
        return [ToolCall(call_id(), plan.named, text.strip())]
    match = TOOL_CALL_TAGS.match(text)
    body = match.group(1) if match else text
    items = complete_items(body) if is_cut else _whole_items(body)
    if not items:
        return None
    names = {t.name for t in plan.tools}
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        calls.append(ToolCall(call_id(), item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls if plan.parallel else calls[:1]  # auto may write several: one if not parallel


def _whole_items(text: str) -> list[Any] | None:
    """A whole output's calls: one JSON value, an array of calls or one call."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past Python's parser (a red team's 1,200 [)
        return None
    return value if isinstance(value, list) else [value]


def complete_items(text: str) -> list[Any] | None:
    """The items an array cut short completed (``[{..}, {..}, {"na`` -> the first two); None
    when ``text`` does not open an array (a lone object cut short is no call)."""
    start = text.lstrip()
    if not start.startswith("["):
        return None
    decoder, items, at = json.JSONDecoder(), [], 1
    while True:
        at = len(start) - len(start[at:].lstrip(" \t\n\r,"))  # separators; the grammar puts them right
        try:
            item, at = decoder.raw_decode(start, at)
        except (ValueError, RecursionError):  # not JSON, or nested past Python's parser (a red team's 1,200 [)
            return items
        items.append(item)


def chat_message(plan: ToolPlan | None, text: str, reason: str | None) -> tuple[ChatMessageOut, str | None]:
    """A choice's message and finish reason, its text read as calls where the plan says so."""
    calls = _calls(plan, text, reason)
    if calls is None:
        return ChatMessageOut(content=_content(plan, text)), reason
    return ChatMessageOut(content=None, tool_calls=[c.dump() for c in calls]), _call_reason(reason, calls)


def _calls(plan: ToolPlan | None, text: str, reason: str | None) -> list[ToolCall] | None:
    if plan is None:
        return None
    if plan.mode != "named" and reason not in ("stop", "length"):  # failed, cancelled: no answer to read
        return None
    return read_calls(plan, text, is_cut=reason == "length")


def _content(plan: ToolPlan | None, text: str) -> str:
    """A choice's content when its text is no call: ``required``'s is nothing (see the module's doc)."""
    return "" if plan is not None and plan.mode == "required" else text


def _call_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    """``tool_calls`` for calls that ended whole. The worker's "stop" is also a stop string's: one
    that cut a named call's arguments short left them unparsable, and "tool_calls" would tell the
    client to run them (red team 3); that stays "stop"."""
    return "tool_calls" if reason == "stop" and all(_parses(call.arguments) for call in calls) else reason


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past Python's parser (a red team's 1,200 [)
        return False
    return True


def _indexed(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"index": i, **call.dump()} for i, call in enumerate(calls)]


class ToolStream:
    """Per choice: the deltas a streamed chat choice sends under a tool plan."""

    def __init__(self, plan: ToolPlan, num_choices: int) -> None:
        self.plan = plan
        self.held = [""] * num_choices  # auto/required: the text so far
        self.is_content = [False] * num_choices  # auto: the answer is plain text, streamed as it comes
        self.ids = [call_id() for _ in range(num_choices)]  # named: each choice's one call

    def opening(self, choice: int) -> dict[str, Any]:
        """The first delta of a choice: the role, and a named function's call."""
        if self.plan.mode != "named":
            return {"role": "assistant", "content": None}
        call = ToolCall(self.ids[choice], self.plan.named or "", "")
        return {"role": "assistant", "content": None, "tool_calls": _indexed([call])}

    def delta(self, choice: int, text: str, reason: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """The delta for one chunk's ``text`` (None: nothing to send yet) and the finish reason to send."""
        if self.plan.mode == "named":
            self.held[choice] += text  # the whole arguments, for the finish reason
            arguments = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
            if reason is None:
                return (arguments or None), None
            call = ToolCall(self.ids[choice], self.plan.named or "", self.held[choice].strip())
            return arguments, _call_reason(reason, [call])
        if self.is_content[choice]:
            content = {"content": text} if text else None
            return (content, None) if reason is None else (content or {}, reason)
        self.held[choice] += text
        start = self.held[choice].lstrip()
        if self.plan.mode == "auto" and start and not start.startswith(CALL_OPENERS):
            self.is_content[choice] = True  # not a call: what was held goes now, the rest as it comes
            return {"content": self.held[choice]}, reason
        if reason is None:
            return None, None
        calls = _calls(self.plan, self.held[choice], reason)
        if calls is None:
            content = _content(self.plan, self.held[choice])
            return ({"content": content} if content else {}), reason
        return {"tool_calls": _indexed(calls)}, _call_reason(reason, calls)
