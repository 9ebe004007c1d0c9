"""Which worker may take a request, and which of those gets it: the router's side of admission.

A worker's requests (its published record, plus the ones any router
dispatched there that the record does not show yet, ``router.reservations``,
plus the candidate) must fit its pool by the admission policy
(``shared.admission``). Each admissible worker is a ``WorkerView``: a
``shared.batch_view.BatchView`` of its record and this router's reservations,
kept until either changes. A worker's published requests change only with
its record, and the reservations only when this router dispatches or learns
another router's dispatch, so a decision costs O(K log n) per worker asked
(not K full peaks) and a dispatch adds its request to one view.

Which of the workers that pass gets the request: workers are visited in
order of their projected use now (use / pool), least loaded first, and of
the first ``CHOICES`` the request fits, the one with the lowest resulting
ratio wins (a small pool that a big request would fill loses to a larger
one). So a decision runs about ``CHOICES`` checks, not one per worker: at 32
workers, checking every one was three quarters of the router's time
(bench/RESULTS.md, the scale test). When the least loaded do not fit, the
walk goes on, so a request waits only if no worker can take it.

Workers publish what their prefix caches hold (``WorkerLoad.prefixes``,
hashes of prefixes at ``shared.prefix_hash`` boundaries), so the choice is
cache-aware (``cache_aware_fit``): the workers holding the longest prefix of
the request's prompt are asked too, and a hit is traded against load. A
prompt this router just sent somewhere counts as held there for
``SENT_TTL_S`` (``Views._sent``): its worker's record shows it only after
its prefill and the next summary, and a burst sharing a new prefix should
meet it rather than scatter.

The check counts only what a request adds to a worker, as the worker's own
check does (``Admission.adds``): a cached prefix that the record's running
requests hold (``WorkerLoad.held_prefixes``) is in their states already, so
at that worker the candidate counts its tokens less that prefix
(``Candidate.less``; the same draws, so still O(K log n)). A prefix that is
only evictable is counted in full: the worker counts it as free, and the
request would hold it again. The discount is never more than the worker's
own at the record's instant: held boundaries are multiples of the hash
block within the ids a worker may match (``cacheable_prompt``), and the
worker lists them after the states, from the same requests. A record can
be stale: if every holder of that prefix ends before the request arrives,
the worker counts it in full and the request may wait there until room
frees (the record then lists it). It never waits there for ever: a
candidate is discounted only where it would fit the pool alone, undiscounted.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from router.adapter_popularity import Popularity, spare_hits
from shared.batch_view import BatchView, Candidate, Policy
from shared.peak import ReqState
from shared.prefix_hash import PREFIX_BLOCK, prefix_hashes
from shared.schemas import GenerateRequest
from shared.worker_load import WorkerLoad

CHOICES = 2
# Cache-aware choice (``cache_aware_fit``): how many of the workers with the longest hits are asked
# besides the least loaded, and what a whole-prompt hit is worth in use ratio (see there).
HIT_CHOICES = 2
HIT_WEIGHT = 0.5
# A prompt sent to a worker counts as cached there this long: the worker's record says so once it
# prefilled it and rebuilt its summary (at most a second, plus a heartbeat). Kept per worker, at
# most SENT_MAX hashes (older ones dropped first).
SENT_TTL_S = 5.0
SENT_MAX = 4096
# Adapter-aware choice (issue 32): a worker holding the request's LoRA adapter in device memory
# (``WorkerLoad.resident_adapters``, or sent one for it within SENT_TTL_S) counts as a hit of this
# share in ``cache_aware_fit``: it saves paging the adapter in and evicting another. 0.5 is worth a
# quarter of the pool in use ratio: the holder wins until its projected use is that far above the
# least loaded's, then the request goes there and a hot adapter spreads to a second worker.
ADAPTER_HIT = 0.5


def least_loaded_fit(
    uses: Mapping[str, float], ratio: Callable[[str], float | None], choices: int = CHOICES
) -> str | None:
    """``uses``: worker -> use ratio now; ``ratio(worker)``: the ratio with the request, None if it
    does not fit. Ties go to the less loaded, then to the lesser id."""
    fitting: list[tuple[float, int, str]] = []
    for _, worker_id in sorted((use, worker_id) for worker_id, use in uses.items()):
        result = ratio(worker_id)
        if result is not None:
            fitting.append((result, len(fitting), worker_id))
            if len(fitting) == choices:
                break
    return min(fitting)[2] if fitting else None


def cache_aware_fit(
    uses: Mapping[str, float],
    hits: Mapping[str, float],
    ratio: Callable[[str], float | None],
    choices: int = CHOICES,
) -> str | None:
    """``least_loaded_fit``'s walk, plus the ``HIT_CHOICES`` workers with the longest hits
    (``hits``: worker -> cached share of the prompt, 0..1); the request fits some of them, and
    the lowest ``ratio - HIT_WEIGHT * hit`` wins.

    The trade-off: a hit saves the prefill of its tokens (the prompt's time to first token and
    the batch's compute), load costs every request there decode time and room. At 0.5, a worker
    holding the whole prompt wins over an empty one until its projected use is half the pool
    above it; beyond that the request goes to the less loaded one, so a hot prefix spreads to a
    second worker when one cannot serve all of it, and a short hit barely moves the choice. A
    worker the request does not fit is never chosen, however long its hit: the request goes
    elsewhere at once instead of waiting for it. Without hits this is ``least_loaded_fit``."""
    asked: dict[str, tuple[float, int] | None] = {}  # worker -> (ratio, order asked), None: no fit

    def ask(worker_id: str) -> bool:
        if worker_id not in asked:
            result = ratio(worker_id)
            asked[worker_id] = None if result is None else (result, len(asked))
        return asked[worker_id] is not None

    for worker_id in sorted(hits, key=lambda w: (-hits[w], uses[w], w))[:HIT_CHOICES]:
        ask(worker_id)
    fitting = 0
    for _, worker_id in sorted((use, worker_id) for worker_id, use in uses.items()):
        fitting += ask(worker_id)
        if fitting == choices:
            break
    scored = [
        (answer[0] - HIT_WEIGHT * hits.get(worker_id, 0.0), answer[0], answer[1], worker_id)
        for worker_id, answer in asked.items()
        if answer is not None
    ]
    return min(scored)[3] if scored else None


# Why a worker was chosen: it holds a prefix of the prompt (a LoRA request: its adapter); others did
# but load won (a LoRA miss: others would lose a less popular adapter); nobody held any (least
# loaded; a LoRA miss: the worker losing the least popular adapter, ``router.adapter_popularity``);
# none could take it (the request waits).
Reason = Literal[
    "prefix_hit", "load_over_hit", "adapter_hit", "load_over_adapter", "adapter_spare", "least_loaded", "wait"
]


def reason(chosen: str | None, hits: Mapping[str, float], adapter: bool = False) -> Reason:
    if chosen is None:
        return "wait"
    if chosen in hits:
        return "adapter_hit" if adapter else "prefix_hit"
    if not hits:
        return "least_loaded"
    return "load_over_adapter" if adapter else "load_over_hit"


class WorkerView(BatchView):
    """A worker's record plus this router's reservations on it (``reserved``: counted as added).
    A draining worker takes nothing."""

    def __init__(self, load: WorkerLoad, reserved: Sequence[ReqState], policy: Policy):
        states = [ReqState(*r) for r in load.requests]
        super().__init__(states, load.max_total_tokens, load.running_max_req_size, policy)
        self.load = load
        self.prefixes = dict(load.prefixes)  # prefix hash -> tokens it covers
        # of those, the ones the record's requests hold (counted in their states)
        self.held = {load.prefixes[i][0]: load.prefixes[i][1] for i in load.held_prefixes if i < len(load.prefixes)}
        self.add(reserved)

    def hit(self, hashes: Sequence[int], within: Mapping[int, int] | None = None) -> int:
        """Tokens of the longest prefix (``hashes``: the prompt's) this worker's cache holds (of
        ``within``: those of its prefixes, by default all)."""
        prefixes = self.prefixes if within is None else within
        for h in reversed(hashes):
            if h in prefixes:
                return prefixes[h]
        return 0

    def ratio(self, candidate: Candidate, held: int = 0) -> float | None:
        """Use / pool with the candidate, ``held`` of whose tokens running requests here hold."""
        return None if self.load.draining else super().ratio(self.adds(candidate, held))

    def adds(self, candidate: Candidate, held: int) -> Candidate:
        """What the candidate adds here: less ``held`` (``Candidate.less``), unless it would not fit
        this pool alone in full (then a stale record could leave it waiting here for ever)."""
        return candidate.less(held) if held and self.fits_alone(candidate) else candidate

    def could_take(self, request: GenerateRequest, count: int, candidate: Callable[[], Candidate]) -> bool:
        """Whether ``request`` (``count`` states) could start here once the pool is empty: within the
        requests it runs at once, and either all its KV tokens within the admission limit or,
        failing that, the estimate of a ``candidate()`` of it (drawn only then: most fit in full)."""
        if self.max_requests is not None and count > self.max_requests:
            return False
        return request.max_tokens_needed <= self.limit or self.fits_alone(candidate())

    def use_ratio(self) -> float:
        """Use now / pool (a draining worker sorts last)."""
        return math.inf if self.load.draining else self.use() / self.max_total_tokens


class Views:
    """A view per admissible worker, kept in step with the router's reservations.

    Invariant: a view has counted exactly the reservations it was built with
    plus every candidate ``admit`` added since; the router admits a decision's
    candidate before its dispatch is sent (so the next decision of the same run
    sees it), and ``refresh`` rebuilds the views of workers whose dispatches
    were not written (those tentative counts are undone) or whose record changed.
    """

    def __init__(self, policy: Policy, clock: Callable[[], float] = time.monotonic, cache_aware: bool = True):
        self.policy = policy
        self.clock = clock
        self.cache_aware = cache_aware  # off: no hits are looked up, so the choice is by load alone
        self._views: dict[str, WorkerView] = {}
        self.last_reason: Reason = "wait"  # why the last ``choose`` chose as it did, for the metrics
        self._sent: dict[str, dict[int, tuple[int, float]]] = {}  # worker -> hash -> (tokens, when sent)
        self._held_at_chosen: tuple[str | None, int] = (None, 0)  # the last choice and its discount (``admit``)
        self._sent_adapters: dict[str, dict[str, float]] = {}  # worker -> LoRA adapter -> when last sent
        self.popularity = Popularity()  # LoRA requests per adapter, recent ones weighing most (a miss's choice)

    def clear(self) -> None:
        """Every view goes (their draws came from an older history)."""
        self._views.clear()

    def refresh(
        self,
        loads: Mapping[str, WorkerLoad],
        pending: Mapping[str, Sequence[ReqState]],
        rebuild: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        views = {}
        for worker_id, load in loads.items():
            view, reserved = self._views.get(worker_id), pending.get(worker_id, ())
            same = (
                view is not None
                and worker_id not in rebuild
                and view.load.seq == load.seq
                and view.load.ts_ms == load.ts_ms
                and view.added == len(reserved)
            )
            views[worker_id] = view if same else WorkerView(load, reserved, self.policy)
        self._views = views
        self._sent = {worker_id: sent for worker_id, sent in self._sent.items() if worker_id in loads}
        oldest = self.clock() - SENT_TTL_S  # what a record shows by now needs no memory of a send
        self._sent_adapters = {
            worker_id: {a: when for a, when in sent.items() if when >= oldest}
            for worker_id, sent in self._sent_adapters.items()
            if worker_id in loads
        }

    def fits_nowhere(self, request: GenerateRequest, states: Sequence[ReqState]) -> bool:
        """Whether no live worker that serves ``request`` (its ``states``) could ever start it, even
        with nothing else running: it would wait at the head of the queue for ever, and its class
        and worse ones behind it. False while none serves it (one may be starting)."""
        views = [v for v in self._views.values() if v.load.takes(request.model, request.adapter)]
        drawn: list[Candidate] = []

        def candidate() -> Candidate:  # one draw for every view, made when first needed
            if not drawn:
                drawn.append(Candidate(states, self.policy))
            return drawn[0]

        return bool(views) and not any(v.could_take(request, len(states), candidate) for v in views)

    def choose(
        self, candidate: Candidate, model: str | None = None, prompt_ids: Sequence[int] = (), adapter: str | None = None
    ) -> str | None:
        """A worker serving ``model`` that the candidate fits, by load and by what its cache holds
        of ``prompt_ids`` (the ids it may find cached: ``cacheable_prompt``; ``cache_aware_fit``),
        or None: the request waits. Where running requests hold a prefix of them, the candidate
        counts only the rest; only workers that load the LoRA ``adapter`` (None: the base model) are
        candidates, and those holding it on the device are preferred (``ADAPTER_HIT``). ``admit`` the
        chosen worker's candidate next."""
        views = {worker_id: view for worker_id, view in self._views.items() if view.load.serves(model, adapter)}
        uses = {worker_id: view.use_ratio() for worker_id, view in views.items()}
        # Hashed for the choice, or for a discount (with --no-cache_aware too: that is admission).
        hashed = len(prompt_ids) >= PREFIX_BLOCK and (self.cache_aware or any(v.held for v in views.values()))
        hashes = prefix_hashes(prompt_ids) if hashed else []
        hits: dict[str, float] = {}  # worker -> cached share of the prompt
        held: dict[str, int] = {}  # worker -> tokens of the prompt its running requests hold
        for worker_id, view in views.items() if hashes else ():
            if view.held and (tokens := view.hit(hashes, view.held)):
                held[worker_id] = tokens
            tokens = self._hit(worker_id, view, hashes) if self.cache_aware else 0
            if tokens:
                hits[worker_id] = tokens / len(prompt_ids)
        spare = False  # a LoRA miss: the hits are the workers that lose the least by paging it in
        if adapter is not None and self.cache_aware:  # its prompt is never cached: holding its adapter is the hit
            hits, spare = self._adapter_hits(views, adapter)
        chosen = cache_aware_fit(uses, hits, lambda w: self._views[w].ratio(candidate, held.get(w, 0)))
        self.last_reason = "adapter_spare" if spare and chosen in hits else reason(chosen, hits, adapter is not None)
        if chosen is not None and adapter is not None:
            self._sent_adapters.setdefault(chosen, {})[adapter] = self.clock()
            self.popularity.count(adapter)  # once a request (a waiting one is chosen for again and again)
        self._held_at_chosen = (chosen, held.get(chosen, 0) if chosen is not None else 0)
        if chosen is not None and hashes and self.cache_aware and views[chosen].load.prefix_cache:
            self._remember(chosen, hashes)
        return chosen

    def _adapter_hits(self, views: Mapping[str, WorkerView], adapter: str) -> tuple[dict[str, float], bool]:
        """The hits of a LoRA request: the workers holding ``adapter`` (``ADAPTER_HIT``), else those
        that would lose the least popular adapter paging it in (``spare_hits``; True then)."""
        hits = {w: ADAPTER_HIT for w in views if self._holds(w, adapter)}
        if hits:
            return hits, False
        return spare_hits(self.popularity, {w: v.load.resident_adapters for w, v in views.items()}), True

    def _holds(self, worker_id: str, adapter: str) -> bool:
        """The worker holds ``adapter`` on its device, by its record or because this router sent it a
        request for it lately (its record shows the adapter only after it paged it in)."""
        if adapter in self._views[worker_id].load.resident_adapters:
            return True
        sent = self._sent_adapters.get(worker_id, {})
        return sent.get(adapter, -math.inf) >= self.clock() - SENT_TTL_S

    def _hit(self, worker_id: str, view: WorkerView, hashes: Sequence[int]) -> int:
        """Tokens of the prompt the worker's cache holds, by its record or by what this router sent
        it lately (not at a worker without a cache: what was sent there was not kept)."""
        sent = self._sent_hit(worker_id, hashes) if view.load.prefix_cache else 0
        return max(view.hit(hashes), sent)

    def _sent_hit(self, worker_id: str, hashes: Sequence[int]) -> int:
        """Tokens of the longest prefix of ``hashes`` this router sent to the worker lately."""
        sent, oldest = self._sent.get(worker_id, {}), self.clock() - SENT_TTL_S
        for h in reversed(hashes):
            entry = sent.get(h)
            if entry is not None and entry[1] >= oldest:
                return entry[0]
        return 0

    def _remember(self, worker_id: str, hashes: Sequence[int]) -> None:
        sent, now = self._sent.setdefault(worker_id, {}), self.clock()
        for k, h in enumerate(hashes):
            sent.pop(h, None)  # re-inserted last: the dict stays in sending order, oldest first
            sent[h] = ((k + 1) * PREFIX_BLOCK, now)
        while len(sent) > SENT_MAX or (sent and next(iter(sent.values()))[1] < now - SENT_TTL_S):
            del sent[next(iter(sent))]

    def admit(self, worker_id: str, candidate: Candidate) -> None:
        """The candidate was sent there: the next decision sees it. Right after ``choose`` chose
        that worker, what it counted there (less the prefix running requests hold)."""
        chosen, held = self._held_at_chosen
        self._held_at_chosen = (None, 0)
        view = self._views.get(worker_id)
        if view is not None:
            view.admit(view.adds(candidate, held if chosen == worker_id else 0))


def cacheable_prompt(request: GenerateRequest) -> Sequence[int]:
    """The prompt ids a worker may find cached for ``request`` (``worker.engine.kv_slots``'s
    ``_matchable`` on the message): all but the last, whose logits it needs, and none when it asks
    for the prompt's logprobs before any output (a cached position has no logits to score). What
    the router hashes, so neither a hit nor a discount counts a token the worker would prefill. None
    for a LoRA adapter's request: its K/V is the adapter's, never shared through the prefix cache."""
    if request.adapter is not None or (request.params.prompt_logprobs is not None and not request.resume_ids):
        return ()
    return request.prompt_ids[:-1]
