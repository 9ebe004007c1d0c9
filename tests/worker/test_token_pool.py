import sys

import numpy as np
import pytest

from worker.engine.token_pool import TokenPool


def test_allocate_and_free_one_token_at_a_time_without_loss():
    pool = TokenPool(10)
    a = pool.allocate(4)
    b = pool.allocate(6)
    assert pool.num_free == 0 and pool.num_used == 10
    assert sorted(np.concatenate([a, b]).tolist()) == list(range(10))
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.free(a)
    assert pool.num_free == 4
    c = pool.allocate(4)
    assert sorted(c.tolist()) == sorted(a.tolist())


def test_freeing_more_than_allocated_is_an_error():
    pool = TokenPool(3)
    with pytest.raises(ValueError):
        pool.free(np.array([0]))


def test_bookkeeping_modules_do_not_need_torch():
    import subprocess

    code = "import sys, worker.engine.token_pool, worker.engine.request; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
