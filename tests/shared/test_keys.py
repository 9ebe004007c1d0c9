import re
import uuid
from collections import Counter

from redis.crc import key_slot

from shared.keys import GROUP_TAGS, GROUPS, Keys, group

KEY = re.compile(r"^lightq(:[a-z]+|:\{[a-z0-9-]+\}|:[A-Za-z0-9._-]+)+$")


def slot(key: str) -> int:
    return key_slot(key.encode())


def test_every_key_has_one_prefix_and_valid_hash_tags():
    keys = Keys("lightq")
    built = [
        keys.requests(),
        keys.requests(2),
        keys.classes(),
        keys.dead_letters(),
        keys.workers(),
        keys.load("w-1"),
        keys.inbox("w-1"),
        keys.preempt("w-1"),
        keys.meta("abc"),
        keys.chunks("abc"),
        keys.channel("abc"),
        keys.data_fence("abc"),
        keys.cancel("abc"),
        keys.output_lengths(),
        keys.reap_lock("w-1"),
        keys.router_alive("r-1"),
        keys.waiting("model-1"),
        keys.waiting(None),
        keys.order(3),
        keys.vtc(3),
        keys.vtime(),
    ]
    for key in built:
        assert KEY.match(key), key
        assert "::" not in key and key.count("{") == 1, key
    assert len(set(built)) == len(built)


def test_the_control_plane_is_one_slot():
    """What the router's dispatch script, the enqueue script and the requeues touch together."""
    keys = Keys("p")
    control = [
        keys.requests(),
        keys.requests(5),
        keys.classes(),
        keys.dead_letters(),
        keys.workers(),
        keys.load("w"),
        keys.inbox("w"),
        keys.preempt("w"),
        keys.reap_lock("w"),
        keys.meta("r1"),
        keys.cancel("r1"),
        keys.output_lengths(),
        keys.enqueued_tokens(),
        keys.waiting("m"),
        keys.order(0),
        keys.vtc(0),
        keys.vtime(),
        keys.tenant_queued(),
        keys.tenant_served(),
        keys.router_decisions(),
        keys.router_alive("r"),
    ]
    assert {slot(k) for k in control} == {slot(keys.requests())}


def test_a_requests_data_keys_share_its_groups_slot_and_channel():
    keys = Keys("p")
    for request_id in ("r1", "x" * 32, "a:b"):
        data = [*keys.data_request_keys(request_id), keys.data_fence(request_id), keys.channel(request_id)]
        tag = "{" + GROUP_TAGS[group(request_id)] + "}"
        assert all(tag in k for k in data)
        assert len({slot(k) for k in data}) == 1
    assert re.fullmatch(keys.channels().replace("*", ".*").replace("{", r"\{").replace("}", r"\}"), keys.channel("a:b"))


def test_groups_spread_evenly_over_primaries_with_equal_slot_ranges():
    """The tags land one per 1/24 of the slots: P primaries owning equal contiguous ranges (what
    ``redis-cli --cluster create`` makes) hold 24/P groups each, and ids fill groups about evenly."""
    for primaries in (1, 2, 3, 4, 6, 8):
        edges = [p * 16384 // primaries for p in range(primaries + 1)]
        owner = Counter(next(p for p in range(primaries) if edges[p] <= slot(t) < edges[p + 1]) for t in GROUP_TAGS)
        assert sorted(owner.values()) == [GROUPS // primaries] * primaries, (primaries, owner)
    counts = Counter(group(uuid.uuid4().hex) for _ in range(24_000))
    assert min(counts.values()) > 800 and max(counts.values()) < 1200
