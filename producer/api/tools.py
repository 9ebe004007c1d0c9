"""OpenAI tool calls: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` as a ``ToolPlan``.

What the model is asked to write, per ``tool_choice``:
- ``none`` (or no tools): plain text; the tools are not shown to the model.
- a named function: the call's arguments only, constrained to its ``parameters`` schema; the
  answer is one call of that function (streamed: the arguments as they are generated).
- ``required``: one ``{"name", "arguments"}`` call or a JSON array of them, constrained to a
  schema whose calls are one object per tool (``const`` name, its parameters); an array of one
  only when ``parallel_tool_calls`` is false, else of at most ``CALLS_PER_TOOL`` per tool.
- ``auto`` (the default with tools): unconstrained. The model is told to answer with such an
  array (or one such object) when it calls; an output that parses as calls of known tools
  (optionally inside ``<tool_call>`` tags, as Hermes-style templates write them) becomes
  ``tool_calls``, anything else is ``content`` (``producer.api.tool_render`` reads and renders them).

A small greedy model forced into an array tends to write its one call again and again
(SmolLM2 did, until ``max_tokens``): so ``required`` lets it write its one call as an object
and stop, and the array's cap makes the grammar close an array that repeats. An array cut
short by ``max_tokens`` still gives the calls it completed (the answer keeps finish reason
``length``). Calls are never merged: the same call twice (two dice rolled, two files made)
is two calls, as the model wrote them.

Tools reach the prompt through the chat template when it knows them (its source mentions
``tools``); otherwise a system message describes them and the format above.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from producer.api.errors import ApiError, bad_request
from producer.api.structured import (
    SchemaLimits,
    check_constraint,
    check_cost,
    parsed,
    schema_constraint,
)
from shared.schemas import Constraint

# ``required`` with parallel calls: the array's maxItems is this times the number of tools. Enough
# for a call per city, file or query of a real request (a call past it cannot be written: the
# docs/api.md says so); few enough that a model repeating its one call ends the array (and its
# answer) after a few hundred tokens instead of at max_tokens.
CALLS_PER_TOOL = 8
# Keywords of a JSON schema whose values are data, and those whose values map names to schemas
# (``hoisted`` rewrites refs in neither's keys, nor anywhere in the former).
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)


class FunctionDef(_Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


def _choice_kind(value: Any) -> str:
    return "str" if isinstance(value, str) else "dict"  # the tags producer.api.errors leaves out of ``param``


# Tagged, so that an object's error names its own field (``{"type": "function", "function": {}}`` was
# told "Input should be 'none', 'auto' or 'required'"), and a string's the three modes.
ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("str")] | Annotated[NamedToolChoice, Tag("dict")],
    Discriminator(_choice_kind),
]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def dump(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolPlan:
    mode: Literal["auto", "required", "named"]
    tools: tuple[FunctionDef, ...]
    parallel: bool = True
    named: str | None = None

    def constraint(self) -> Constraint | None:
        if self.mode == "named":
            return Constraint(kind="json_schema", spec=json.dumps(self._parameters(self.named)))
        if self.mode == "required":
            return Constraint(kind="json_schema", spec=json.dumps(self._calls_schema()))
        return None

    def _parameters(self, name: str | None) -> dict[str, Any]:
        function = next(t for t in self.tools if t.name == name)
        return function.parameters or {"type": "object"}

    def _calls_schema(self) -> dict[str, Any]:
        """One call of any tool, or an array of them. Each tool's parameters sit in the root's
        ``$defs`` under its name, their local refs rewritten to point there (``hoisted``): a ref is
        resolved from the root of the whole schema, where a tool's own ``#/$defs/X`` meant nothing."""
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": {"$ref": f"#/$defs/{t.name}"}},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        call = {"anyOf": items}
        max_items = CALLS_PER_TOOL * len(self.tools) if self.parallel else 1
        return {
            "$defs": {t.name: hoisted(t.parameters or {"type": "object"}, f"#/$defs/{t.name}") for t in self.tools},
            "anyOf": [call, {"type": "array", "items": call, "minItems": 1, "maxItems": max_items}],
        }

    @property
    def constrained(self) -> set[str]:
        """The tools whose parameters the forced call's grammar holds."""
        if self.mode == "named":
            return {self.named or ""}
        return {t.name for t in self.tools} if self.mode == "required" else set()

    def system_prompt(self) -> str:
        """The tools and the call format, for a chat template that does not render tools itself."""
        listed = "\n".join(
            json.dumps({"name": t.name, "description": t.description or "", "parameters": t.parameters or {}})
            for t in self.tools
        )
        if self.mode == "named":
            ask = f"Answer with only the JSON arguments of a call to {self.named}."
        else:
            ask = (
                'To call functions, answer with only a JSON array of calls, each {"name": <function name>, '
                '"arguments": <arguments object>}.'
            )
            if self.mode == "auto":
                ask += " If no function is needed, answer normally."
        return f"You can call these functions:\n{listed}\n{ask}"


def plan_tools(
    tools: list[Tool] | None, tool_choice: ToolChoice | None, parallel: bool | None, has_legacy: bool
) -> ToolPlan | None:
    """The plan for a chat request's tool fields, or None (no tools, or ``none``); 400s as OpenAI."""
    if has_legacy:
        raise bad_request(
            "functions and function_call are deprecated and not supported; use tools and tool_choice",
            param="functions",
            code="unsupported_parameter",
        )
    if tool_choice is not None and not tools:
        raise bad_request(
            "tool_choice is only allowed when tools are specified", param="tool_choice", code="invalid_tool_choice"
        )
    if not tools or tool_choice == "none":
        return None
    functions = tuple(t.function for t in tools)
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", param="tools", code="invalid_tools")
    if isinstance(tool_choice, NamedToolChoice):
        if tool_choice.function.name not in names:
            raise bad_request(
                f"tool_choice: no tool named {tool_choice.function.name!r} in tools",
                param="tool_choice",
                code="invalid_tool_choice",
            )
        return ToolPlan("named", functions, parallel is not False, tool_choice.function.name)
    return ToolPlan(tool_choice or "auto", functions, parallel is not False)


class CalledFunction(_Request):
    name: str
    arguments: str


class ToolCallIn(_Request):
    """A call in an assistant message of the conversation (a round trip's earlier turn)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


def _arguments(call: ToolCallIn) -> Any:
    """A call's arguments as an object where they parse (transformers' form), else the text as sent."""
    try:
        return json.loads(call.function.arguments or "{}")
    except (ValueError, RecursionError):  # nested past Python's parser: a 500 before (red team 5)
        return call.function.arguments


def template_calls(calls: list[ToolCallIn]) -> list[dict[str, Any]]:
    """Calls as chat templates take them."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _arguments(c)}}
        for c in calls
    ]


def calls_text(calls: list[ToolCallIn]) -> str:
    """Calls as the text the model was asked to write (templates that cannot render calls)."""
    return json.dumps([{"name": c.function.name, "arguments": _arguments(c)} for c in calls], ensure_ascii=False)


def hoisted(schema: Any, base: str) -> Any:
    """``schema`` as it reads at JSON pointer ``base`` of a bigger schema: every local ``$ref``
    (``#...``) made to point under ``base``. Names of properties and definitions are names, and
    ``const``, ``enum``, ``default`` and ``examples`` are data: neither is rewritten. Tool names are
    ``[A-Za-z0-9_-]``, so ``base`` needs no JSON-pointer escapes."""
    if isinstance(schema, list):
        return [hoisted(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in DATA_KEYWORDS:
            out[key] = value
        elif key in NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: hoisted(item, base) for name, item in value.items()}
        else:
            out[key] = hoisted(value, base)
    return out


def _tool_param(n: int) -> str:
    return f"tools.{n}.function.parameters"


def check_tools_cost(plan: ToolPlan, limits: SchemaLimits) -> None:
    """Each tool's parameters within the schema limits, and all of them together: every one is parsed,
    so 60 tools each just within the pattern cost took 21 s of the producer's CPU a request (red team 5)."""
    chars = cost = 0
    for n, tool in enumerate(plan.tools):
        if tool.parameters is not None:
            constraint = schema_constraint(tool.parameters)
            cost += check_cost(constraint, _tool_param(n), limits)
            chars += len(constraint.spec)
    if chars > limits.chars or cost > limits.pattern_cost:
        what = (
            f"{chars} characters, more than max_schema_chars ({limits.chars})"
            if chars > limits.chars
            else f"counted repetitions costing {cost}, more than max_schema_pattern_cost ({limits.pattern_cost})"
        )
        raise bad_request(
            f"tools: their parameters together have {what}; offer fewer tools or smaller schemas",
            param="tools",
            code="constraint_too_large" if chars > limits.chars else "constraint_too_costly",
        )


async def output_constraint(
    requested: Constraint | None, param: str, plan: ToolPlan | None, limits: SchemaLimits
) -> Constraint | None:
    """The one grammar a chat answer follows, checked and parsed (400s): ``requested`` (named
    ``param``: response_format or another server's field) or a forced call's. Every tool's parameters
    are within the limits and valid: parsed once, inside the forced call's grammar or alone."""
    if plan is None:
        return await check_constraint(requested, param, limits)
    check_tools_cost(plan, limits)
    forced = plan.constraint()
    if forced is not None and requested is not None:
        raise bad_request(
            f"{param} cannot be combined with a tool_choice that forces a call",
            param=param,
            code="invalid_response_format",
        )
    inside = plan.constrained
    for n, tool in enumerate(plan.tools):
        if tool.parameters is not None and tool.name not in inside:
            await parsed(schema_constraint(tool.parameters), _tool_param(n))
    if forced is None:
        return await check_constraint(requested, param, limits)
    names = [t.name for t in plan.tools]
    if plan.mode == "named":
        return await parsed(forced, _tool_param(names.index(plan.named or "")))
    try:
        return await parsed(forced, "tool_choice")
    except ApiError:
        for n, tool in enumerate(plan.tools):  # which tool: each alone, on this error path only
            if tool.parameters is not None:
                await parsed(schema_constraint(tool.parameters), _tool_param(n))
        raise
