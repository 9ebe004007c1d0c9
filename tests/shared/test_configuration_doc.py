"""docs/configuration.md is generated from the settings classes and must not drift from them."""

import difflib
import json
import subprocess
import sys
from pathlib import Path

from lightq.config_doc import COMMAND, render

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"

# render() in a fresh interpreter that sees `cores` cores when the settings modules compute their defaults.
RENDER_WITH_CORES = """
import json, os, sys
cores = int(sys.argv[1])
os.sched_getaffinity = lambda pid: set(range(cores))
os.cpu_count = lambda: cores
from lightq.config_doc import render
print(json.dumps(render()))
"""


def render_with_cores(cores: int) -> str:
    out = subprocess.run(
        [sys.executable, "-c", RENDER_WITH_CORES, str(cores)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    return json.loads(out)


def test_committed_configuration_doc_is_rendered_from_the_settings():
    committed, rendered = DOC.read_text(), render()
    if committed != rendered:
        diff = difflib.unified_diff(
            committed.splitlines(), rendered.splitlines(), "docs/configuration.md", "render()", lineterm="", n=0
        )
        raise AssertionError(
            f"docs/configuration.md differs from the settings classes (shared/config.py, shared/*_settings.py); "
            f"regenerate it with: {COMMAND}\n" + "\n".join(list(diff)[:20])
        )


def test_every_setting_is_documented_with_its_environment_variable():
    from lightq.cli import SERVICES
    from shared.config import ServeSettings
    from shared.flags import flat_fields

    text = render()
    for cls in [*SERVICES.values(), ServeSettings]:
        for flag in flat_fields(cls):
            assert f"`--{flag}`" in text and f"`LIGHTQ_{flag.upper()}`" in text, flag


def test_configuration_doc_is_the_same_on_every_machine():
    """Defaults computed from the core count (producers, publishers) render as their rule, not a number."""
    one, many = render_with_cores(1), render_with_cores(64)
    assert one == many, "a default depends on the core count: describe it in lightq.config_doc.MACHINE_DEFAULTS"
    assert one == render()
