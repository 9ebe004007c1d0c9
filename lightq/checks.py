"""``lightq serve`` checks everything it can before it starts a child.

A bad setting or model source found in a child only shows as that child
failing over and over; found here it is one line and a non-zero exit.
Each check raises ``SystemExit`` with the line (``lightq: ...``).
"""

from __future__ import annotations

import re
import socket
from typing import Any

from pydantic import SecretStr, ValidationError
from pydantic_settings import BaseSettings

from shared.flags import build, flat_fields
from shared.model_files import resolve

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_serve(flags: dict[str, Any], classes: list[type[BaseSettings]], num_workers: int) -> None:
    """Every settings class builds (flags and ``LIGHTQ_*`` environment), the model source exists,
    the device is there; ``classes``: the settings of every service serve starts."""
    if num_workers < 1:
        raise SystemExit(f"lightq: --workers {num_workers}: at least 1")
    built = {cls: build_or_exit(cls, flags) for cls in classes}
    if num_workers > 1 and any(getattr(s, "worker_id", None) for s in built.values()):
        # Several workers under one id share one heartbeat, record and inbox: a frozen one is never
        # found dead (the other beats for it) and the pool never sees them as two.
        raise SystemExit(f"lightq: --worker_id names one worker; --workers {num_workers} start several (drop it)")
    model_dir = flags.get("model_dir") or next(s.model.model_dir for s in built.values() if hasattr(s, "model"))
    try:
        resolve(model_dir)
    except FileNotFoundError as exc:
        raise SystemExit(f"lightq: {exc}") from None
    for settings in built.values():
        if hasattr(settings, "device"):
            check_device(settings.device, settings.dtype)
            model = settings.model
            check_lora(
                model.lora_modules, model_dir, settings.tp, model.max_lora_rank, settings.max_loras, model.weights_cache
            )
        if hasattr(settings, "host"):
            check_port(settings.host, settings.port)


def build_or_exit(cls: type[BaseSettings], flags: dict[str, Any]) -> BaseSettings:
    try:
        return build(cls, flags)
    except ValidationError as exc:
        raise SystemExit(f"lightq: {settings_error(cls, exc)}") from None


def settings_error(cls: type[BaseSettings], exc: ValidationError) -> str:
    """The first error as one line naming the flag and its environment variable."""
    error = exc.errors()[0]
    field = str(error["loc"][0]) if error["loc"] else ""
    flag, info = next(
        (
            (flag, info)
            for flag, (parent, name, info) in flat_fields(cls).items()
            if name == field and _owner(cls, parent).__name__ == exc.title
        ),
        (field, None),
    )
    said = f"--{flag} (env LIGHTQ_{flag.upper()}): {error['msg'].lower()}"
    # A secret's value (API keys; a URL may hold a password) is never echoed to a terminal or a log.
    if info is not None and (info.annotation is SecretStr or flag.endswith("url")):
        return said
    return f"{said}, not {error.get('input')!r}"


def _owner(cls: type[BaseSettings], parent: str | None) -> type:
    return cls if parent is None else cls.model_fields[parent].annotation


def check_port(host: str, port: int) -> None:
    """The producer's port is free (a second serve on one port would fail in its producer, again and again)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise SystemExit(f"lightq: --host {host} --port {port}: cannot listen there ({exc.strerror})") from None


def check_lora(specs: list[str], model_dir: str, tp: int, max_rank: int, spare: int = 0, cache: str = "") -> None:
    """Each ``--lora_modules`` adapter fits the model (its files, shapes, modules, rank), and
    --max_loras has a model to adapt: a worker would stop at start otherwise, and serve would restart
    it until it gave up."""
    if not specs and not spare:
        return
    from worker.lora.adapter_set import check_adapters

    try:
        check_adapters(specs, model_dir, tp, max_rank, spare, cache)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"lightq: {exc}") from None


def check_device(device: str, dtype: str) -> None:
    """``--device`` names a device this machine has, ``--dtype`` one torch type."""
    if dtype not in DTYPES:
        raise SystemExit(f"lightq: --dtype {dtype}: one of {', '.join(DTYPES)}")
    if not DEVICE.fullmatch(device):
        raise SystemExit(f"lightq: --device {device}: one of auto, cpu, cuda, cuda:N")
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(
            f"lightq: --device {device}: CUDA is not available on this machine "
            f"(torch {torch.__version__}); use --device cpu or auto"
        )
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise SystemExit(f"lightq: --device {device}: only {torch.cuda.device_count()} GPU(s) visible")
