"""The compose files agree with what `lightq serve` does on one machine."""

from pathlib import Path

import yaml

from lightq.launcher import CPU_MALLOC

ROOT = Path(__file__).resolve().parents[1]


class ComposeLoader(yaml.SafeLoader):
    """Compose's own tags (`!reset`) read as plain values."""


ComposeLoader.add_constructor("!reset", lambda loader, node: None)


def test_cpu_workers_get_serves_malloc_settings():
    # serve sets these for CPU workers (a 10-15% prefill cost without them); compose's CPU override must too
    cpu = yaml.load((ROOT / "docker-compose.cpu.yml").read_text(), Loader=ComposeLoader)
    env = cpu["services"]["worker"]["environment"]
    assert {k: str(env.get(k)) for k in CPU_MALLOC} == CPU_MALLOC
