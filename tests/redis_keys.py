"""A test's keys read back from Redis: what its 'leaves no trace' checks compare."""

from __future__ import annotations

import redis


def keys_with_prefix(client: redis.Redis, prefix: str) -> list[str]:
    """Every key under a test's prefix: for 'leaves no trace' checks."""
    return sorted(client.scan_iter(match=f"{prefix}:*", count=1000))
