"""Which worker may take a request, and which of those gets it: the router's side of admission.

A worker's requests (its published record, plus the ones any router
dispatched there that the record does not show yet, ``router.workers.reservations``,
plus the candidate) must fit its pool by the admission policy
(``shared.admission``). Each admissible worker is a ``WorkerView``
(``router.admission.worker_view``): a ``shared.batch_view.BatchView`` of its
record and this router's reservations, kept until either changes. A worker's
published requests change only with its record, and the reservations only
when this router dispatches or learns another router's dispatch, so a
decision costs O(K log n) per worker asked (not K full peaks) and a dispatch
adds its request to one view.

Which of the workers that pass gets the request: by load, and by what their
prefix caches hold (``router.admission.choice``). A prompt this router just
sent somewhere counts as held there for ``SENT_TTL_S`` (``Views._sent``):
its worker's record shows it only after its prefill and the next summary,
and a burst sharing a new prefix should meet it rather than scatter.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence

from router.admission.choice import Reason, cache_aware_fit, reason
from router.admission.worker_view import WorkerView
from router.lora.adapter_popularity import Popularity, spare_hits
from shared.batch_view import Candidate, Policy
from shared.peak import ReqState
from shared.prefix_hash import PREFIX_BLOCK, prefix_hashes
from shared.schemas import GenerateRequest
from shared.worker_load import WorkerLoad

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
        self,
        candidate: Candidate,
        model: str | None = None,
        prompt_ids: Sequence[int] = (),
        adapter: str | None = None,
        brings: bool = False,
    ) -> str | None:
        """A worker serving ``model`` that the candidate fits, by load and by what its cache holds
        of ``prompt_ids`` (the ids it may find cached: ``cacheable_prompt``; ``cache_aware_fit``),
        or None: the request waits. Where running requests hold a prefix of them, the candidate
        counts only the rest; only workers that load the LoRA ``adapter`` (None: the base model) are
        candidates, and those holding it on the device are preferred (``ADAPTER_HIT``); ``brings``: the
        request brings its adapter (``GenerateRequest.brings_adapter``), so while no worker lists it
        (unloaded) those that can load it are candidates. ``admit`` the chosen worker's candidate next."""
        views = {worker_id: view for worker_id, view in self._views.items() if view.load.serves(model, adapter)}
        if not views and brings:  # only then: a worker that lists it (or failed to load it) knows better
            views = {w: v for w, v in self._views.items() if v.load.serves(model) and v.load.adopts_adapters}
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
