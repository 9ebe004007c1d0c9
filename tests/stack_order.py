"""The order of the tests that share a ``lightq serve`` stack (tests.integration.stack.SharedStack).

Each shared stack is a session fixture (its tests take ``<name>_stack``): ``smollm2_pair`` in
tests/conftest.py, the others in tests/integration/conftest.py. tests/conftest.py's collection hooks run
a stack's tests one after another (``group_users``) and note the last of them (``note_last_users``); the
stack stops after that test (``last_user``), not at the session's end.
"""

from __future__ import annotations

import pytest

SHARED_STACKS = ("smollm2_pair", "smollm2_single", "counting_trio", "counting_cluster")
_LAST_USER: dict[str, str] = {}  # a shared stack's name -> the node id of the last test that uses it


def group_users(items: list[pytest.Item]) -> None:
    """Each shared stack's tests one after another, where the first of them was (``items`` in place)."""
    for name in SHARED_STACKS:
        users = [item for item in items if name in item.fixturenames]
        if users:
            first = items.index(users[0])
            rest = [item for item in items if name not in item.fixturenames]
            items[:] = rest[:first] + users + rest[first:]


def mark_xdist_groups(items: list[pytest.Item]) -> None:
    """Each test's ``xdist_group``: its shared stack's name, else its module's path."""
    for item in items:
        stack = next((name for name in SHARED_STACKS if name in item.fixturenames), None)
        item.add_marker(pytest.mark.xdist_group(stack or item.nodeid.split("::")[0]))


def note_last_users(items: list[pytest.Item]) -> None:
    """The last test of the run (what -k / -m left) that uses each shared stack."""
    for item in items:
        for name in SHARED_STACKS:
            if name in item.fixturenames:
                _LAST_USER[name] = item.nodeid


def last_user(name: str, request: pytest.FixtureRequest) -> bool:
    return _LAST_USER.get(name) == request.node.nodeid
