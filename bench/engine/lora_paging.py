"""How a run pages LoRA adapters in: ``bench.engine.offline`` with the page-ins counted, by where
their copy came from (a staging buffer filled ahead, or the host at the page-in), in order, with
the admission passes between them ('|').

    TRITON_INTERPRET=1 python3 -m bench.engine.lora_paging --model-shape tiny --device cpu --num-requests 150 \\
        --lora-adapters 150 --lora-files 4 --lora-resident 16 --lora-rank 4 --lora-page-batch 4 --lora-prefetch 12

Any ``bench.engine.offline`` flags. On a CPU the staging buffers are forced on (the worker stages only
on a GPU), so the paging logic of the 1,000-adapter run replays at a small scale in Triton's
interpreter; the timings of such a run mean nothing, the counts are the point.
"""

from __future__ import annotations

from collections import Counter

from bench.engine import offline
from worker.engine.engine import Engine
from worker.lora.adapter_set import AdapterSet
from worker.lora.staging import Staging


def main(argv: list[str] | None = None) -> Counter:
    counts: Counter = Counter()
    order: list[str] = []
    install, write, admit = AdapterSet.install, Staging.write, Engine._admit

    def staged_install(self, model, staging=None):
        return install(self, model, staging=True)

    def counted_write(self, name, pieces, flat):
        kind = "staged" if name in self.staged else "direct"
        counts[kind] += 1
        order.append(kind[0].upper())
        return write(self, name, pieces, flat)

    def marked_admit(self):
        if order and order[-1] != "|":
            order.append("|")
        return admit(self)

    AdapterSet.install, Staging.write, Engine._admit = staged_install, counted_write, marked_admit
    try:
        offline.main(argv)
    finally:
        AdapterSet.install, Staging.write, Engine._admit = install, write, admit
    print(f"page-ins: {counts['staged'] + counts['direct']}, {counts['staged']} from a staging buffer filled ahead")
    print(f"in order (S staged, D direct, | an admission pass): {''.join(order)}")
    return counts


if __name__ == "__main__":
    main()
