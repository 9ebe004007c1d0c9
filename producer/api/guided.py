"""Other servers' constraint fields on the OpenAI routes, as lightq's own ``Constraint``.

What vLLM's and SGLang's clients send through the openai client's ``extra_body``: vLLM's
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` and its newer
``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``),
SGLang's ``json_schema``, ``regex`` and ``ebnf``. Each becomes the constraint lightq already
applies (``guided_choice`` an EBNF grammar of its strings); none is ignored: a field that would
change the output but cannot be honoured (``guided_whitespace_pattern``, ``structural_tag``) is a
400, and so are two constraints in one request (``response_format`` other than ``text`` and a
forced tool call count too). ``structured_outputs``' switches that change nothing here are
accepted: lightq's JSON is always compact, additional properties are refused unless the schema
allows them, and there is no other backend to fall back to.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from producer.api.errors import bad_request
from producer.api.structured import schema_constraint
from shared.schemas import Constraint


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False, populate_by_name=True)


class StructuredOutputs(_Request):
    """vLLM's ``structured_outputs``: one of its constraints."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None  # refused
    whitespace_pattern: str | None = None  # refused
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False


class GuidedFields(_Request):
    """The fields, for the OpenAI bodies to inherit."""

    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    json_schema: dict[str, Any] | bool | str | None = None  # SGLang
    regex: str | None = None  # SGLang
    ebnf: str | None = None  # SGLang
    guided_whitespace_pattern: str | None = None  # refused
    structural_tag: Any = None  # refused

    def guided(self) -> tuple[Constraint, str] | None:
        """The constraint these fields ask for and the field that asks; 400 for one that cannot be
        honoured, or for more than one."""
        for name in ("guided_whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise _unsupported(name)
        given = [(c, p) for c, p in self._top_level() if c is not None]
        if self.structured_outputs is not None:
            given += [(c, p) for c, p in _outputs(self.structured_outputs) if c is not None]
        if len(given) > 1:
            raise bad_request(f"{' and '.join(p for _, p in given)}: give at most one constraint", param=given[1][1])
        return given[0] if given else None

    def _top_level(self) -> list[tuple[Constraint | None, str]]:
        return [
            (_schema(self.guided_json), "guided_json"),
            (_schema(self.json_schema), "json_schema"),
            (_text("regex", self.guided_regex), "guided_regex"),
            (_text("regex", self.regex), "regex"),
            (_choice(self.guided_choice), "guided_choice"),
            (_text("ebnf", self.guided_grammar), "guided_grammar"),
            (_text("ebnf", self.ebnf), "ebnf"),
        ]


def _outputs(outputs: StructuredOutputs) -> list[tuple[Constraint | None, str]]:
    for name in ("structural_tag", "whitespace_pattern"):
        if getattr(outputs, name) is not None:
            raise _unsupported(f"structured_outputs.{name}")
    return [
        (_schema(outputs.json_), "structured_outputs.json"),
        (_text("regex", outputs.regex), "structured_outputs.regex"),
        (_choice(outputs.choice), "structured_outputs.choice"),
        (_text("ebnf", outputs.grammar), "structured_outputs.grammar"),
        (Constraint(kind="json") if outputs.json_object else None, "structured_outputs.json_object"),
    ]


def _schema(schema: dict[str, Any] | bool | str | None) -> Constraint | None:
    return None if schema is None else schema_constraint(schema)


def _text(kind: str, spec: str | None) -> Constraint | None:
    return None if spec is None else Constraint(kind=kind, spec=spec)


def _choice(choices: list[str] | None) -> Constraint | None:
    """Exactly one of ``choices``: an EBNF alternation of string literals (JSON's escapes are xgrammar's)."""
    if choices is None:
        return None
    return Constraint(kind="ebnf", spec="root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))


def _unsupported(param: str) -> Exception:
    return bad_request(f"{param} is not supported", param=param, code="unsupported_parameter")
