"""The only serialiser on any wire: pydantic models as JSON (never pickle)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)

FIELD = "msg"  # the single field of every stream entry we write


def encode(message: BaseModel) -> str:
    return message.model_dump_json()


def decode(cls: type[M], data: str | bytes) -> M:
    return cls.model_validate_json(data)


def entry(message: BaseModel) -> dict[str, str]:
    """Fields for XADD."""
    return {FIELD: encode(message)}


def from_entry(cls: type[M], fields: Mapping[Any, str | bytes]) -> M:
    """The message in a stream entry's fields (read with or without decode_responses)."""
    raw = fields.get(FIELD) if FIELD in fields else fields.get(FIELD.encode())
    if raw is None:
        raise ValueError(f"stream entry has no {FIELD!r} field: {list(fields)}")
    return decode(cls, raw)
