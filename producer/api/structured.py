"""Structured output at the edge: OpenAI's ``response_format`` and LightLLM's constraint parameters
as a wire ``Constraint``, checked and parsed before anything is queued.

The check first bounds what a parse may cost, without parsing: a spec longer than
``--max_schema_chars``, a JSON schema nested deeper than ``--max_schema_depth``, or one whose
regex patterns ask for more counted repetition than ``--max_schema_pattern_cost``, is a 400
naming the limit (xgrammar's conversion of a schema grows much faster than its nesting: 4 ms at
64 levels of JSON, 3 s at 400; and with the square of a pattern's counts: 7 s for one
``[a-z]{3,6400}``, a minute for a thousand patterns of a few hundred). Then xgrammar parses it
(``Grammar.from_json_schema``, ``from_regex``, ``from_ebnf``; no tokenizer needed, off the event
loop): a bad one is a 400 naming the parameter and xgrammar's reason. The parse travels with the
request as ``Constraint.grammar`` (xgrammar's EBNF text), so the worker compiles exactly what was
checked here and never converts the schema again.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from producer.api.errors import ApiError, bad_request
from shared.lora import GONE, is_gone
from shared.producer_settings import ProducerSettings
from shared.schemas import Constraint
from shared.worker_load import TOO_LARGE, is_too_large

XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[01:02:03] /x/y.cc:12: " before the reason
COUNTED = re.compile(r"\{(\d+)(?:,(\d*))?\}")  # {n}, {m,} and {m,n}: their largest count
DEEP = object()  # json_value of a text nested past Python's parser
WHAT = {"json_schema": "JSON schema", "regex": "regular expression", "ebnf": "EBNF grammar"}


@dataclass(frozen=True)
class SchemaLimits:
    """The cost bounds a constraint's spec is checked against before it is parsed."""

    chars: int  # --max_schema_chars
    depth: int  # --max_schema_depth
    pattern_cost: int  # --max_schema_pattern_cost

    @classmethod
    def of(cls, settings: ProducerSettings) -> SchemaLimits:
        return cls(settings.max_schema_chars, settings.max_schema_depth, settings.max_schema_pattern_cost)


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = Field(None, description="accepted; lightq always enforces the schema")


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> Constraint | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return Constraint(kind="json")
        if self.json_schema is None:
            raise bad_request(
                "response_format.json_schema is required when type is 'json_schema'",
                param="response_format.json_schema",
                code="invalid_response_format",
            )
        return schema_constraint(self.json_schema.schema_)


def schema_constraint(schema: dict[str, Any] | bool | str) -> Constraint:
    """A JSON schema (an object, true, or its JSON text) as a constraint; true (or {}) is any JSON."""
    spec = schema if isinstance(schema, str) else json.dumps(schema if schema is not True else {})
    return Constraint(kind="json_schema", spec=spec)


def native_constraint(
    guided_json: dict[str, Any] | str | None, regular_constraint: str | None, guided_grammar: str | None
) -> Constraint | None:
    """LightLLM's ``/generate`` constraint parameters (at most one): a JSON schema, a regex, an EBNF grammar."""
    given = [(n, v) for n, v in (("guided_json", guided_json), ("regular_constraint", regular_constraint),
                                 ("guided_grammar", guided_grammar)) if v is not None]  # fmt: skip
    if len(given) > 1:
        names = " and ".join(f"parameters.{n}" for n, _ in given)
        raise bad_request(f"{names}: give at most one constraint", param=f"parameters.{given[1][0]}")
    if not given:
        return None
    name, value = given[0]
    if name == "guided_json":
        return schema_constraint(value)
    return Constraint(kind="regex" if name == "regular_constraint" else "ebnf", spec=value)


NATIVE_NAMES = {"json_schema": "guided_json", "regex": "regular_constraint", "ebnf": "guided_grammar"}


def json_value(text: str) -> Any:
    """``text`` as JSON; ``DEEP`` past about a thousand levels (Python's parser gives up there, deeper
    than any bound), ``None`` when it is not JSON (the parse then says why)."""
    try:
        return json.loads(text)
    except RecursionError:
        return DEEP
    except ValueError:
        return None


def json_depth(value: Any, bound: int) -> int:
    """How deep ``value`` nests JSON objects and arrays, counted up to ``bound + 1`` (the walk stops there)."""
    if value is DEEP:
        return bound + 1
    deepest, stack = 0, [(value, 0)]
    while stack and deepest <= bound:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def pattern_cost(value: Any) -> int:
    """What the regexes of schema ``value`` (each ``pattern`` string, each ``patternProperties`` key)
    ask of xgrammar's conversion: over their counted repetitions, the largest count squared (the
    conversion's time grows with it). An escaped brace counts too: an overestimate, never a miss."""
    cost, stack = 0, [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            regexes = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
            if isinstance(node.get("patternProperties"), dict):
                regexes += list(node["patternProperties"])
            cost += sum(max(int(m), int(n or 0)) ** 2 for regex in regexes for m, n in COUNTED.findall(regex))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return cost


def check_cost(constraint: Constraint, param: str, limits: SchemaLimits) -> int:
    """A 400 naming the limit when ``constraint`` may cost more to parse than the limits allow; else
    its patterns' cost (0 for a regex or grammar)."""
    if len(constraint.spec) > limits.chars:
        raise bad_request(
            f"{param}: {len(constraint.spec)} characters, more than max_schema_chars ({limits.chars})",
            param=param,
            code="constraint_too_large",
        )
    if constraint.kind != "json_schema":
        return 0
    value = json_value(constraint.spec)
    if json_depth(value, limits.depth) > limits.depth:
        raise bad_request(
            f"{param}: objects and arrays nested more than max_schema_depth ({limits.depth}) levels deep",
            param=param,
            code="schema_too_deep",
        )
    if (cost := pattern_cost(value)) > limits.pattern_cost:
        raise bad_request(
            f"{param}: its patterns' counted repetitions cost {cost} (the sum of each largest count squared), "
            f"more than max_schema_pattern_cost ({limits.pattern_cost}); ask for shorter counts or fewer patterns",
            param=param,
            code="constraint_too_costly",
        )
    return cost


def parse(constraint: Constraint) -> str:
    """xgrammar's parse of ``constraint`` as EBNF text (what the worker compiles); raises on a bad one."""
    import xgrammar as xgr  # imported on first use: the producer's start-up does not pay for it

    if constraint.kind == "json_schema":
        return str(xgr.Grammar.from_json_schema(constraint.spec, any_whitespace=False))
    if constraint.kind == "regex":
        return str(xgr.Grammar.from_regex(constraint.spec))
    return str(xgr.Grammar.from_ebnf(constraint.spec))


def parse_error(constraint: Constraint, param: str, exc: Exception) -> ApiError:
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    reason = XGRAMMAR_PREFIX.sub("", lines[0])
    what = WHAT[constraint.kind]
    return bad_request(f"{param}: invalid {what}: {reason}", param=param, code="invalid_" + constraint.kind)


def check_no_min_tokens(constraint: Constraint | None, min_tokens: int, param: str) -> None:
    """A minimum length holds the stop token back, which a complete grammar needs: refused together."""
    if constraint is not None and min_tokens:
        raise bad_request(
            f"{param} cannot be combined with a constrained output (response_format, a forced tool call, "
            f"or a grammar parameter): a complete answer must be able to end",
            param=param,
            code="unsupported_parameter",
        )


async def check_constraint(constraint: Constraint | None, param: str, limits: SchemaLimits) -> Constraint | None:
    """``constraint`` with its parse (``grammar``), or a 400: over the limits, or not a valid one."""
    if constraint is None or constraint.kind == "json":
        return constraint
    check_cost(constraint, param, limits)
    return await parsed(constraint, param)


async def parsed(constraint: Constraint, param: str) -> Constraint:
    """``constraint`` with its parse (``grammar``), its cost already checked; 400 when it is not valid."""
    try:
        grammar = await asyncio.to_thread(parse, constraint)
    except (RuntimeError, ValueError) as exc:  # xgrammar reports bad input as RuntimeError
        raise parse_error(constraint, param, exc) from None
    return constraint.model_copy(update={"grammar": grammar})


def failure(error: str | None) -> ApiError:
    """The answer to a request that ended in ``error`` on the worker: a 400 when its constraint could
    not be applied there (the client's to change: ``Constraint.error_code``), a 404 when its LoRA
    adapter was unloaded before it started (``shared.lora.is_gone``), a 400 when no worker could ever
    take it (``shared.worker_load.misfit``, found by the router), else a 500."""
    code = Constraint.error_code(error)
    if code is not None:
        return ApiError(400, error or code, code=code)
    if is_too_large(error):
        return ApiError(400, (error or "").split(": ", 1)[1], code=TOO_LARGE)
    if is_gone(error):  # its adapter was unloaded while it waited: as an unknown adapter is
        return ApiError(404, (error or "").split(": ", 1)[1], param="model", code=GONE)
    return ApiError(500, error or "generation failed", code="generation_failed", kind="server_error")
