"""The suite's 'leaves no trace' check on the shared local Redis: keys without a TTL that its tests left.

Taken over the whole run (``tests/conftest.py``'s session hooks: in xdist's controller when the suite
runs on several workers, so one worker's end never sees another's keys in use). Keys with a TTL go by
themselves. What others write meanwhile is left out: keys of other test runs (their ``lightq-test-<hex>``
prefix was not given here), and keys under a namespace that had keys before the run (a ``lightq serve``
of the user's on the same Redis), unless they carry one of this run's prefixes (rq keys name them).
An embedded Redis goes with its session: nothing to check.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import redis

from shared.redis import answers

TEST_PREFIX = re.compile(r"lightq-test-[0-9a-f]{10}")  # redis_settings' prefixes (also in rq names)


@dataclass(frozen=True)
class LeakCheck:
    url: str
    before: frozenset[str]  # the keys there at the start

    @classmethod
    def start(cls, url: str) -> LeakCheck | None:
        """The snapshot at the run's start; None where no Redis answers at ``url``."""
        if not answers(url):
            return None
        client = redis.Redis.from_url(url, decode_responses=True)
        try:
            return cls(url, frozenset(client.scan_iter(count=1000)))
        finally:
            client.close()

    def leaked(self, prefixes: set[str]) -> list[str]:
        """The run's keys without a TTL (``prefixes``: the ``lightq-test-`` ones its tests were given)."""
        namespaces = {key.partition(":")[0] for key in self.before}
        client = redis.Redis.from_url(self.url, decode_responses=True)
        try:
            new = set(client.scan_iter(count=1000)) - self.before
            return sorted(key for key in new if client.ttl(key) == -1 and _ours(key, prefixes, namespaces))
        finally:
            client.close()


def _ours(key: str, mine: set[str], namespaces: set[str]) -> bool:
    found = TEST_PREFIX.findall(key)
    if found:
        return any(prefix in mine for prefix in found)
    return key.partition(":")[0] not in namespaces
