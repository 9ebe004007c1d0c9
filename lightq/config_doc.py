"""``docs/configuration.md``, generated from the settings classes.

    .venv/bin/python -m lightq.config_doc > docs/configuration.md

Every setting of every service, grouped by settings class as ``lightq serve
--help`` groups its flags (``shared.flags``): its flag, its environment
variable, its type, its default and its description. Which commands take a
group, the flags of ``serve`` that are not settings, and LightLLM's flag
names are read from the ``lightq`` parser itself. A test
(``tests/shared/test_configuration_doc.py``) fails when the committed file
differs from ``render()``.

Defaults computed from the machine when the settings modules are imported
(the core count) are written as the rule, never as this machine's number, so
the file is the same on every machine (``MACHINE_DEFAULTS``; the test renders
with 1 core and with 64 cores and compares).
"""

from __future__ import annotations

import argparse
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import SecretStr
from pydantic_settings import BaseSettings

from shared.flags import PREFIX, _title, flat_fields

COMMAND = ".venv/bin/python -m lightq.config_doc > docs/configuration.md"

# Settings whose default is computed from the machine at import: (class, field) -> the rule.
MACHINE_DEFAULTS = {
    ("WorkerSettings", "publishers"): (
        "1; 2 on hosts with 16 cores or more (`shared.worker_settings.default_publishers`)"
    ),
    ("ModelSettings", "weights_cache"): "`$XDG_CACHE_HOME/lightq/weights`, `~/.cache/lightq/weights` without it",
}


def _commands() -> dict[str, argparse.ArgumentParser]:
    from lightq.cli import parser

    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _options(command: argparse.ArgumentParser) -> set[str]:
    return {option for action in command._actions for option in action.option_strings}


def _groups() -> dict[type[BaseSettings], list[tuple[str, Any]]]:
    """Settings class -> its (flag, FieldInfo) rows, in ``lightq serve --help``'s order."""
    from lightq.cli import SERVICES
    from shared.config import ServeSettings

    groups: dict[type[BaseSettings], list[tuple[str, Any]]] = {}
    seen: set[str] = set()
    for cls in [*SERVICES.values(), ServeSettings]:
        for flag, (parent, _, info) in flat_fields(cls).items():
            if flag in seen:
                continue
            seen.add(flag)
            owner = cls.model_fields[parent].annotation if parent else cls
            groups.setdefault(owner, []).append((flag, info))
    return groups


def _type(annotation: Any) -> str:
    if annotation is bool:
        return "switch"
    if annotation is SecretStr:
        return "secret text"
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(f"`{choice}`" for choice in get_args(annotation))
    if get_origin(annotation) in (Union, types.UnionType):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        if len(inner) == 1:
            return f"{_type(inner[0])} (optional)"
    if get_origin(annotation) is list:
        return f"list of {_type(get_args(annotation)[0])}"
    return {int: "integer", float: "number", str: "text"}.get(annotation, str(annotation))


BOUNDS = (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"))


def _bounds(info: Any) -> str:
    """A field's range as pydantic checks it (``Field(gt=0, le=1)`` -> ``> 0, ≤ 1``)."""
    return ", ".join(
        f"{sign} {getattr(rule, name)}"
        for rule in info.metadata
        for name, sign in BOUNDS
        if getattr(rule, name, None) is not None
    )


def _default(cls: type[BaseSettings], field: str, info: Any) -> str:
    if (cls.__name__, field) in MACHINE_DEFAULTS:
        return MACHINE_DEFAULTS[cls.__name__, field]
    default = info.default
    if isinstance(default, bool):
        return "on" if default else "off"
    if default is None:
        return "none"
    if isinstance(default, SecretStr):
        default = default.get_secret_value()
    if default == "":
        return "empty"
    return f"`{default}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def _field_name(cls: type[BaseSettings], flag: str) -> str:
    return next(name for f, (_, name, _) in flat_fields(cls).items() if f == flag)


def _table(cls: type[BaseSettings], rows: list[tuple[str, Any]]) -> list[str]:
    lines = ["| Flag | Environment variable | Type | Default | Description |", "|---|---|---|---|---|"]
    for flag, info in rows:
        name = f"`--{flag}` / `--no-{flag}`" if info.annotation is bool else f"`--{flag}`"
        default = _default(cls, _field_name(cls, flag), info)
        kind = _type(info.annotation) + (f", {_bounds(info)}" if _bounds(info) else "")
        lines.append(
            f"| {name} | `{PREFIX}{flag.upper()}` | {kind} | {_cell(default)} | {_cell(info.description or '')} |"
        )
    return lines


def _serve_extras(serve: argparse.ArgumentParser, settings_flags: set[str]) -> list[str]:
    """Rows of ``lightq serve``'s own flags (not settings) and of LightLLM's names."""
    own, aliases = [], []
    for group in serve._action_groups:
        for action in group._group_actions:
            if not action.option_strings or action.dest == "help":
                continue
            row = f"| {' / '.join(f'`{o}`' for o in action.option_strings)} | {_cell(action.help or '')} |"
            if group.title == "LightLLM's flag names":
                aliases.append(row)
            elif action.dest not in settings_flags and action.dest != "version":
                own.append(row)
    lines = [
        "## Flags of `lightq serve` that are not settings",
        "",
        "They have no environment variable.",
        "",
        "| Flag | Description |",
        "|---|---|",
        *own,
        "",
    ]
    lines += [
        "## LightLLM's flag names",
        "",
        "Accepted by the commands that have the setting they stand for, so LightLLM command lines keep working.",
        "",
        "| Flag | Description |",
        "|---|---|",
        *aliases,
        "",
    ]
    return lines


def render() -> str:
    commands = _commands()
    groups = _groups()
    settings_flags = {flag for rows in groups.values() for flag, _ in rows}
    lines = [
        "# Configuration",
        "",
        f"<!-- Generated from shared/config.py, shared/producer_settings.py and shared/worker_settings.py by "
        f"`{COMMAND}`; do not edit by hand. -->",
        "",
        "Every setting is a command-line flag and an environment variable: the flag's name is the "
        f"variable's without `{PREFIX}`, lower-cased (`--max_total_token_num` is "
        f"`{PREFIX}MAX_TOTAL_TOKEN_NUM`, `--redis_url` is `{PREFIX}REDIS_URL`). A flag given wins, then "
        "the environment, then the default. `lightq serve` passes the flags it was given to its "
        "child processes as these variables. On/off settings are switches (`--cuda_graphs` / "
        "`--no-cuda_graphs`; in the environment `true` or `false`); a list is several values after "
        "the flag (`--eos_id 2 7`) or JSON in the environment (`[2, 7]`).",
        "",
        "The settings are grouped by the class that holds them (in `shared/config.py`, `shared/producer_settings.py` "
        "or `shared/worker_settings.py`), as "
        "`lightq <command> --help` groups them; a group shared by several services (Redis, model, "
        "admission) is listed once, with the commands that take it.",
        "",
    ]
    for cls, rows in groups.items():
        flags = {f"--{flag}" for flag, _ in rows}
        users = [name for name, command in commands.items() if flags <= _options(command)]
        doc = (cls.__doc__ or "").strip().splitlines()
        lines += [
            f"## {_title(cls).capitalize()}",
            "",
            f"`{cls.__name__}`; taken by "
            + ", ".join(f"`lightq {name}`" for name in users)
            + "."
            + (f" {doc[0].replace('``', '`')}" if doc else ""),
            "",
        ]
        lines += [*_table(cls, rows), ""]
    lines += _serve_extras(commands["serve"], settings_flags)
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
