"""Command-line flags generated from the settings classes (no hand-kept argparse).

A flag's name is its environment variable without ``LIGHTQ_``, lower-cased:
``--max_total_token_num`` is ``LIGHTQ_MAX_TOTAL_TOKEN_NUM``, ``--redis_url`` is
``LIGHTQ_REDIS_URL``. Flags left out fall back to the environment, then to
the defaults, because only the flags given are passed to the constructor.

On/off settings are switches (``--cuda_graphs`` / ``--no-cuda_graphs``). Help
is grouped by settings class (a service's own settings, then each shared part
once), each flag with one default. LightLLM's flag names that mean the same
as one of ours are accepted too (``LIGHTLLM_ALIASES``): they set our setting,
or are accepted and ignored where lightq has nothing to choose.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from importlib import metadata
from typing import Any, Literal, get_args, get_origin

from pydantic import SecretStr
from pydantic_settings import BaseSettings

PREFIX = "LIGHTQ_"
IGNORED = "lightllm_ignored_"  # dest prefix of LightLLM flags accepted without effect (given() drops them)
METAVARS = {int: "N", float: "X", str: "TEXT"}
LIGHTLLM_DTYPES = {
    "fp16": "float16",
    "float16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "float32": "float32",
    "auto": "auto",
}


def _flag_name(settings_cls: type[BaseSettings], field: str) -> str:
    env_prefix = settings_cls.model_config.get("env_prefix", "")
    return f"{env_prefix}{field}".removeprefix(PREFIX).lower()


def _nested(settings_cls: type[BaseSettings]) -> dict[str, type[BaseSettings]]:
    return {
        name: info.annotation
        for name, info in settings_cls.model_fields.items()
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseSettings)
    }


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


def _title(cls: type[BaseSettings]) -> str:
    """A settings class as a help group's title: ``WorkerSettings`` -> ``worker settings``."""
    name = cls.__name__.removesuffix("Settings")
    return f"{'rq-worker' if name == 'RqWorker' else name.lower()} settings"


def _group(parser: argparse.ArgumentParser, groups: dict[str, Any], cls: type[BaseSettings]) -> Any:
    title = _title(cls)
    if title not in groups:
        doc = (cls.__doc__ or "").strip().splitlines()
        groups[title] = parser.add_argument_group(title, doc[0] if doc else None)
    return groups[title]


def _help(flag: str, info: Any) -> str:
    """The description with one default (none when the description already says it) and the variable."""
    text = (info.description or "").replace("%", "%%")
    default = info.default
    if isinstance(default, bool):
        default = "on" if default else "off"
    shown = default not in (None, "") and not isinstance(default, SecretStr) and not callable(default)
    if shown and "default" not in text:
        return f"{text} (default: {default}; env {PREFIX}{flag.upper()})"
    return f"{text} (env {PREFIX}{flag.upper()})"


def _argument(info: Any) -> dict[str, Any]:
    """argparse keywords for a field's type: a switch for a bool, choices for a Literal."""
    annotation = info.annotation
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if get_origin(annotation) is Literal:
        return {"choices": list(get_args(annotation))}
    if get_origin(annotation) is list and get_args(annotation) == (str,):
        return {"nargs": "+", "type": str, "metavar": "VALUE"}  # list[str]: ``--lora_modules a=/x b=/y``
    inner = [a for a in get_args(annotation) if a is not type(None)]
    if annotation not in METAVARS and len(inner) == 1 and inner[0] in METAVARS:
        annotation = inner[0]  # ``int | None``: an int when given
    if annotation in METAVARS:
        return {"type": annotation, "metavar": METAVARS[annotation]}
    if get_args(annotation) and list in (get_origin(a) for a in get_args(annotation)):
        return {"nargs": "+", "type": int, "metavar": "ID"}  # list[int] | None: ``--eos_id 2 7``
    return {"type": str, "metavar": "VALUE"}  # pydantic converts (``int | None``, secrets)


def add_flags(parser: argparse.ArgumentParser, *classes: type[BaseSettings]) -> None:
    """Every leaf field of ``classes`` as a flag, grouped by settings class; each flag once."""
    seen: set[str] = set()
    groups: dict[str, Any] = {}
    for cls in classes:
        nested = _nested(cls)
        for flag, (parent, _, info) in flat_fields(cls).items():
            if flag in seen:
                continue
            seen.add(flag)
            group = _group(parser, groups, nested[parent] if parent else cls)
            group.add_argument(f"--{flag}", default=None, help=_help(flag, info), **_argument(info))
    add_lightllm_aliases(parser, seen)


def _lightllm_dtype(value: str) -> str:
    if value not in LIGHTLLM_DTYPES:
        raise argparse.ArgumentTypeError(f"one of {', '.join(LIGHTLLM_DTYPES)}")
    return LIGHTLLM_DTYPES[value]


def add_lightllm_aliases(parser: argparse.ArgumentParser, flags: set[str]) -> None:
    """LightLLM's names for the same settings, where the parser has the setting they stand for."""
    group = parser.add_argument_group("LightLLM's flag names", "accepted so LightLLM command lines keep working")
    if "dtype" in flags:
        group.add_argument(
            "--data_type",
            dest="dtype",
            type=_lightllm_dtype,
            default=None,
            metavar="TYPE",
            help="LightLLM's --dtype: fp16, bf16, fp32 (or their long names)",
        )
    if "cuda_graphs" in flags:
        group.add_argument(
            "--disable_cudagraph",
            dest="cuda_graphs",
            action="store_const",
            const=False,
            default=None,
            help="LightLLM's --no-cuda_graphs",
        )
    if "prefix_cache" in flags:
        for name in ("--disable_prefix_cache", "--disable_dynamic_prompt_cache"):
            group.add_argument(
                name,
                dest="prefix_cache",
                action="store_const",
                const=False,
                default=None,
                help="the same as --no-prefix_cache",
            )
    if "model_dir" in flags:
        group.add_argument(
            "--tokenizer_mode",
            dest=f"{IGNORED}tokenizer_mode",
            choices=["auto", "fast"],
            default=None,
            help="accepted and ignored: lightq always uses the fast tokenizer (LightLLM's 'slow' mode is not offered)",
        )
        group.add_argument(
            "--trust_remote_code",
            dest=f"{IGNORED}trust_remote_code",
            action="store_const",
            const=True,
            default=None,
            help="accepted and ignored: lightq runs its own model code, never code shipped with a model",
        )


def add_version(parser: argparse.ArgumentParser) -> None:
    try:
        version = metadata.version("lightq")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        version = "unknown (not installed)"
    parser.add_argument("--version", action="version", version=f"lightq {version}")


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The flags actually given on the command line (LightLLM's ignored ones left out)."""
    return {k: v for k, v in vars(args).items() if v is not None and not k.startswith(IGNORED)}


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


def from_argv(
    settings_cls: type[BaseSettings], prog: str, description: str | None, argv: Sequence[str] | None = None
) -> BaseSettings:
    """``settings_cls`` from a service module's own command line (``python -m router.main --help``):
    the flags ``lightq <service>`` takes, the environment filling the rest."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_flags(parser, settings_cls)
    return build(settings_cls, given(parser.parse_args(None if argv is None else list(argv))))


def as_env(flags: dict[str, Any]) -> dict[str, str]:
    """Given flags as environment variables, for child processes (lists as JSON, as pydantic reads them)."""
    return {f"{PREFIX}{flag.upper()}": _env_value(value) for flag, value in flags.items()}


def _env_value(value: Any) -> str:
    if isinstance(value, list):
        return json.dumps(value)  # ``[2, 7]``, ``["a=/x"]``: JSON, as pydantic reads lists
    return str(value)
