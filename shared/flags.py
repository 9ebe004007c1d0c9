"""Command-line flags generated from the settings classes (no hand-kept argparse).

A flag's name is its environment variable without ``LIGHTQ_``, lower-cased:
``--max_total_token_num`` is ``LIGHTQ_MAX_TOTAL_TOKEN_NUM``, ``--redis_url`` is
``LIGHTQ_REDIS_URL``. Flags left out fall back to the environment, then to
the defaults, because only the flags given are passed to the constructor.
"""

from __future__ import annotations

import argparse
from typing import Any

from pydantic_settings import BaseSettings

PREFIX = "LIGHTQ_"


def _flag_name(settings_cls: type[BaseSettings], field: str) -> str:
    env_prefix = settings_cls.model_config.get("env_prefix", "")
    return f"{env_prefix}{field}".removeprefix(PREFIX).lower()


def _nested(settings_cls: type[BaseSettings]) -> dict[str, type[BaseSettings]]:
    return {name: info.annotation for name, info in settings_cls.model_fields.items()
            if isinstance(info.annotation, type) and issubclass(info.annotation, BaseSettings)}


def flat_fields(settings_cls: type[BaseSettings]) -> dict[str, tuple[str | None, str, Any]]:
    """flag -> (nested field or None, field name, FieldInfo) for every leaf field."""
    nested = _nested(settings_cls)
    out: dict[str, tuple[str | None, str, Any]] = {}
    for name, info in settings_cls.model_fields.items():
        if name in nested:
            for sub, sub_info in nested[name].model_fields.items():
                out[_flag_name(nested[name], sub)] = (name, sub, sub_info)
        else:
            out[_flag_name(settings_cls, name)] = (None, name, info)
    return out


def add_flags(parser: argparse.ArgumentParser, *classes: type[BaseSettings]) -> None:
    seen: set[str] = set()
    for cls in classes:
        for flag, (_, _, info) in flat_fields(cls).items():
            if flag in seen:
                continue
            seen.add(flag)
            kind = info.annotation if info.annotation in (int, float, str) else str
            default = info.default if info.default is not None and not callable(info.default) else None
            parser.add_argument(f"--{flag}", type=kind, default=None,
                                help=f"{info.description or ''} (default: {default}; env {PREFIX}{flag.upper()})")


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The flags actually given on the command line."""
    return {k: v for k, v in vars(args).items() if v is not None}


def build(settings_cls: type[BaseSettings], flags: dict[str, Any]) -> BaseSettings:
    """Construct the settings: given flags win, the environment fills the rest."""
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for flag, (parent, name, _) in flat_fields(settings_cls).items():
        if flag in flags:
            if parent is None:
                top[name] = flags[flag]
            else:
                nested.setdefault(parent, {})[name] = flags[flag]
    for parent, cls in _nested(settings_cls).items():
        top[parent] = cls(**nested.get(parent, {}))
    return settings_cls(**top)


def as_env(flags: dict[str, Any]) -> dict[str, str]:
    """Given flags as environment variables, for child processes."""
    return {f"{PREFIX}{flag.upper()}": str(value) for flag, value in flags.items()}
