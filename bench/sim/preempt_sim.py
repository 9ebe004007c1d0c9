"""``bench.sim.fair_sim``'s priority figure with preempt and resume: router ``--preempt``, and simulated
workers that answer its asks as ``worker.engine.preempt`` does (issue 19).

    .venv/bin/python -m bench.sim.preempt_sim --only priority

A ``PreemptingWorker`` reads its ``{q}:w:ID:preempt`` list before each step and, per ask,
pauses the newest running requests of classes worse than the ask's (never one paused
``MAX_PREEMPTIONS`` times) until there is a request slot for each asked-for request, or as
many as it can (the simulated pool is sized so that slots, not tokens, bound it). Each goes
back to the ingress stream with its generated count as ``resume_ids``
(``shared.requeue.send_back``), and a worker that takes one continues from that count. Its
record carries ``preemptible`` and ``preempt_asks_read`` as a worker's does. The time model
charges nothing for the recompute (a real worker prefills prompt + output again): the figure
shows the scheduling; the recompute is counted (``recomputed`` tokens), not timed.
"""

from __future__ import annotations

from bench.sim import fair_sim
from bench.sim.fair_sim import TimedWorker
from shared.codec import decode, from_entry
from shared.keys import WORKER_GROUP
from shared.requeue import send_back
from shared.schemas import GenerateRequest
from shared.worker_load import PreemptAsk, tally_preemptible

MAX_PREEMPTIONS = 2
RESUMED: dict[str, int] = {}  # request id -> tokens it generated before its pause (shared by the sim's workers)
COUNTS = {"preemptions": 0, "recomputed": 0}


class PreemptingWorker(TimedWorker):
    asks_read = 0

    def messages(self) -> dict[str, GenerateRequest]:
        """The running requests' messages, from the inbox (an entry stays there until it ends)."""
        msgs = (from_entry(GenerateRequest, f) for _, f in self.client.xrange(self.keys.inbox(self.worker_id)))
        return {m.id: m for m in msgs}

    def step(self, done) -> None:
        self._answer_asks()
        before = {r[0] for r in self.running}
        first = {rid: self.books.first[rid] for rid in RESUMED if rid in self.books.first}
        super().step(done)
        for req in self.running:
            if req[0] not in before and req[0] in RESUMED:  # resumed here: after its tokens
                req[2] += RESUMED.pop(req[0])
        self.books.first.update(first)  # its first token came in the first attempt

    def _answer_asks(self) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.lrange(self.keys.preempt(self.worker_id), 0, -1)
        pipe.delete(self.keys.preempt(self.worker_id))
        raw, _ = pipe.execute()
        if not raw:
            return
        msgs = self.messages()
        asks = [decode(PreemptAsk, r) for r in raw]
        priority = max(a.priority for a in asks)  # a victim is worse than every ask (one class here)
        self._hand_back_unread(msgs, priority)
        read = {r[0] for r in self.running}
        # What will want a slot: the running, the unread entries kept, and the asked-for requests
        # (in the inbox already, or on their way), as a real worker counts its queue.
        queued = {rid for rid, m in msgs.items() if rid not in read and m.priority <= priority}
        queued |= {rid for a in asks for rid in a.request_ids}
        need = len(self.running) + len(queued) - self.args.batch  # slots to free
        worse = [
            r
            for r in reversed(self.running)
            if r[0] in msgs and msgs[r[0]].priority > priority and msgs[r[0]].preemptions < MAX_PREEMPTIONS
        ]
        worse.sort(key=lambda r: -msgs[r[0]].priority)  # stable: newest first inside a class
        if need > 0 and worse:  # room for as many of the asked-for requests as can be made
            self._pause(worse[:need], msgs)
        self.asks_read += len(raw)
        self.beat()

    def _hand_back_unread(self, msgs: dict[str, GenerateRequest], priority: int) -> None:
        """Entries of a worse class this worker has not read yet go back as they came: a real worker
        has them in its queue, where the plan pauses them first (newest, nothing lost); here, read
        oldest first, they would take the room before the requests sent with the ask."""
        read = {r[0] for r in self.running}
        unread = [(m.id, m) for m in msgs.values() if m.id not in read and m.priority > priority]
        entries = {from_entry(GenerateRequest, f).id: i for i, f in self.client.xrange(self.keys.inbox(self.worker_id))}
        pipe = self.client.pipeline(transaction=False)
        for rid, msg in unread:
            send_back(pipe, self.keys, msg)
            pipe.xack(self.keys.inbox(self.worker_id), WORKER_GROUP, entries[rid])
            pipe.xdel(self.keys.inbox(self.worker_id), entries[rid])
        pipe.execute()

    def _pause(self, victims: list[list], msgs: dict[str, GenerateRequest]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for rid, prompt, generated, _, inbox_id in victims:
            msg = msgs[rid]
            # ``generated`` counts earlier attempts' tokens too (``step`` adds them on resume)
            update = {"resume_ids": [1] * generated, "preemptions": msg.preemptions + 1}
            send_back(pipe, self.keys, msg.model_copy(update=update))
            pipe.xack(self.keys.inbox(self.worker_id), WORKER_GROUP, inbox_id)
            pipe.xdel(self.keys.inbox(self.worker_id), inbox_id)
            RESUMED[rid] = generated
            COUNTS["preemptions"] += 1
            COUNTS["recomputed"] += prompt + generated
        pipe.execute()
        self.running = [r for r in self.running if r not in victims]

    def record_extras(self) -> dict:
        """What a router needs to pick a worker to ask, beside scale_sim's record."""
        msgs = self.messages() if self.running else {}
        pausable = []
        for rid, prompt, generated, _, _ in self.running:
            msg = msgs.get(rid)
            if msg is not None and msg.preemptions < MAX_PREEMPTIONS:
                pausable.append((msg.priority, prompt + generated, 1))
        return {"preemptible": tally_preemptible(pausable), "preempt_asks_read": self.asks_read}


def main(argv: list[str] | None = None) -> None:
    fair_sim.main(argv, worker_class=PreemptingWorker, preempt=True)
    print(f"  preemptions {COUNTS['preemptions']}, recomputed tokens {COUNTS['recomputed']} (not timed)")


if __name__ == "__main__":
    main()
