"""Structured output at the edge: OpenAI's ``response_format`` and LightLLM's constraint parameters
as a wire ``Constraint``, checked before anything is queued.

The check parses the constraint with xgrammar (``Grammar.from_json_schema``, ``from_regex``,
``from_ebnf``): the same converter the worker compiles with, so a schema that passes here
compiles there too. It needs no tokenizer (the worker compiles against its own) and costs
milliseconds; it runs off the event loop all the same. A bad one is a 400 naming the
parameter and xgrammar's reason.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from producer.api.errors import bad_request
from shared.schemas import Constraint

XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[01:02:03] /x/y.cc:12: " before the reason
MAX_SPEC_CHARS = 200_000  # a schema or grammar larger than this is refused (the body limit is larger)


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


def _parse(constraint: Constraint) -> None:
    import xgrammar as xgr  # imported on first use: the producer's start-up does not pay for it

    if constraint.kind == "json_schema":
        xgr.Grammar.from_json_schema(constraint.spec, any_whitespace=False)
    elif constraint.kind == "regex":
        xgr.Grammar.from_regex(constraint.spec)
    elif constraint.kind == "ebnf":
        xgr.Grammar.from_ebnf(constraint.spec)


def check_no_min_tokens(constraint: Constraint | None, min_tokens: int, param: str) -> None:
    """A minimum length holds the stop token back, which a complete grammar needs: refused together."""
    if constraint is not None and min_tokens:
        raise bad_request(
            f"{param} cannot be combined with a constrained output (response_format, a forced tool call, "
            f"or a grammar parameter): a complete answer must be able to end",
            param=param,
            code="unsupported_parameter",
        )


async def check_constraint(constraint: Constraint | None, param: str) -> None:
    """A 400 unless the worker will be able to compile ``constraint``."""
    if constraint is None or constraint.kind == "json":
        return
    if len(constraint.spec) > MAX_SPEC_CHARS:
        raise bad_request(f"{param}: more than {MAX_SPEC_CHARS} characters", param=param, code="constraint_too_large")
    try:
        await asyncio.to_thread(_parse, constraint)
    except (RuntimeError, ValueError) as exc:  # xgrammar reports bad input as RuntimeError
        what = {"json_schema": "JSON schema", "regex": "regular expression", "ebnf": "EBNF grammar"}[constraint.kind]
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        reason = XGRAMMAR_PREFIX.sub("", lines[0])
        raise bad_request(
            f"{param}: invalid {what}: {reason}", param=param, code="invalid_" + constraint.kind
        ) from None
