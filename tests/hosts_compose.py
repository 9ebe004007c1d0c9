"""A compose file's services as processes on the hosts of ``tests.hosts``: what Docker would run in
each container, run without Docker (none runs on these machines), one host per service.

``load(path, env)`` reads the file as Compose does: YAML (anchors and merge keys resolved), then
``${VAR:-default}`` / ``${VAR}`` interpolated from ``env`` and ``$$`` turned into ``$`` in every
string. ``argv(service)`` is the container's command line (entrypoint, then command);
``environment(service)`` its variables. What Docker adds is not reproduced: the image's filesystem
(a service runs this machine's binaries, so ``redis-server`` must be a 7.x on PATH), its working
directory, its user; a test says which of those matter where it uses this.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?::?-([^}]*))?\}|\$(\w+)")


class ComposeLoader(yaml.SafeLoader):
    """Compose's own tags (``!reset``, ``!override``) read as their plain values."""


ComposeLoader.add_constructor("!reset", lambda loader, node: None)
ComposeLoader.add_constructor("!override", lambda loader, node: loader.construct_object(node, deep=True))


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's interpolation of one string (``${VAR:-default}`` also when VAR is set but empty)."""

    def value(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(3)
        found = env.get(name, "")
        default = match.group(2)
        return found if found or default is None else default

    return VARIABLE.sub(value, text)


def _walk(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_walk(item, env) for item in node]
    if isinstance(node, dict):
        return {key: _walk(item, env) for key, item in node.items()}
    return node


def load(path: str | Path, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The file as Compose sees it, before merging with other files."""
    return _walk(yaml.load(Path(path).read_text(), Loader=ComposeLoader), env or {})


def argv(service: Mapping[str, Any]) -> list[str]:
    """Entrypoint then command, each a list (the exec form) or a string split as a shell would."""
    parts: list[str] = []
    for key in ("entrypoint", "command"):
        value = service.get(key) or []
        parts += shlex.split(value) if isinstance(value, str) else [str(v) for v in value]
    return parts


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    """The service's variables, from the mapping or the ``KEY=VALUE`` list form."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}
