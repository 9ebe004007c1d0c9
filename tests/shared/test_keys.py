import re

from shared.keys import Keys

KEY = re.compile(r"^lightq(:[a-z]+|:\{[a-z]+(:[A-Za-z0-9._-]+)?\})+$")


def test_every_key_has_one_prefix_and_valid_hash_tags():
    keys = Keys("lightq")
    built = [
        keys.requests(),
        keys.dead_letters(),
        keys.workers(),
        keys.load("w-1"),
        keys.inbox("w-1"),
        keys.meta("abc"),
        keys.chunks("abc"),
        keys.channel("abc"),
        keys.cancel("abc"),
        keys.output_lengths(),
        keys.reap_lock("w-1"),
        keys.router_alive("r-1"),
        keys.waiting("model-1"),
        keys.waiting(None),
        keys.order(-1),
        keys.vtc(3),
        keys.vtime(),
    ]
    for key in built:
        assert KEY.match(key), key
        assert "::" not in key
    assert len(set(built)) == len(built)


def test_request_keys_share_one_cluster_slot_tag():
    keys = Keys("p")
    tags = {re.search(r"\{[^}]*\}", k).group(0) for k in keys.all_request_keys("r1") + [keys.channel("r1")]}
    assert tags == {"{r:r1}"}
    assert keys.load("w").split(":{")[1].startswith("w:w}")
