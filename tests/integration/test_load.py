"""The load script at CI scale: every accepted request finishes (bench/serving/load.py)."""

import argparse

import pytest

from bench.serving.load import run

pytestmark = pytest.mark.slow


def test_a_thousand_requests_with_four_workers_none_lost():
    result = run(argparse.Namespace(requests=1000, workers=4, concurrency=32, new_tokens=8, timeout=300))
    assert result["lost"] == 0
    assert result["dispatch_p99_ms"] >= result["dispatch_p50_ms"] >= 0
