"""The choice among admissible workers: least loaded first, a few checks per decision (no Redis)."""

from router.admission.choice import least_loaded_fit


def pick(uses, ratios, choices=2):
    asked = []

    def ratio(worker_id):
        asked.append(worker_id)
        return ratios[worker_id]

    return least_loaded_fit(uses, ratio, choices), asked


def test_of_the_two_least_loaded_that_fit_the_lower_resulting_ratio_wins():
    uses = {"a": 0.5, "b": 0.1, "c": 0.3}
    assert pick(uses, {"a": 0.2, "b": 0.6, "c": 0.4}) == ("c", ["b", "c"])  # a is never asked
    assert pick(uses, {"a": 0.2, "b": 0.3, "c": 0.4}) == ("b", ["b", "c"])


def test_the_walk_goes_on_past_workers_the_request_does_not_fit():
    uses = {"a": 0.5, "b": 0.1, "c": 0.3, "d": 0.9}
    assert pick(uses, {"a": 0.7, "b": None, "c": None, "d": 0.95}) == ("a", ["b", "c", "a", "d"])
    assert pick(uses, {"a": None, "b": None, "c": None, "d": 0.95}) == ("d", ["b", "c", "a", "d"])
    assert pick(uses, {"a": None, "b": None, "c": None, "d": None})[0] is None


def test_ties_go_to_the_less_loaded_then_the_lesser_id():
    assert pick({"a": 0.2, "b": 0.1}, {"a": 0.5, "b": 0.5})[0] == "b"
    assert pick({"b": 0.1, "a": 0.1}, {"a": 0.5, "b": 0.5})[0] == "a"


def test_one_choice_takes_the_least_loaded_that_fits():
    assert pick({"a": 0.2, "b": 0.1}, {"a": 0.3, "b": 0.9}, choices=1) == ("b", ["b"])
