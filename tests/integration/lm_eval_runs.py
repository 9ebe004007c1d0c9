"""lm-eval's runs of the local multiple-choice task (``lm_eval_task/``) for
tests/integration/test_structured_stack.py: the same task through ``local-completions`` against a
running lightq and through lm-eval's own ``hf`` backend, each giving its accuracy and every
choice's loglikelihood."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest

TASK_DIR = os.path.join(os.path.dirname(__file__), "lm_eval_task")
TASK = "lightq_questions"


@dataclass(frozen=True)
class Scores:
    accuracy: float
    loglikelihoods: list[list[float]]  # per question (doc_id order), per choice


def offline(monkeypatch: pytest.MonkeyPatch, cache_dir: str) -> None:
    """No hub: the environment lm-eval, datasets and transformers read (at import, so before
    lm_eval is first imported), and datasets' cache in ``cache_dir`` (read at each load, so this
    holds even where datasets was imported earlier)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", cache_dir)
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache_dir)
    monkeypatch.chdir(TASK_DIR)  # the task's data_files are relative to the working directory


def run(model: str, model_args: dict[str, Any], batch_size: int = 1) -> Scores:
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=TASK_DIR, include_defaults=False)
    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=[TASK], task_manager=tasks, batch_size=batch_size, log_samples=True
    )
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    # each choice's response is (loglikelihood, is_greedy)
    loglikelihoods = [[float(resp[0]) for resp in s["filtered_resps"]] for s in samples]
    return Scores(out["results"][TASK]["acc,none"], loglikelihoods)


def local_completions(base_url: str, model: str, tokenizer_dir: str) -> Scores:
    """lightq through its OpenAI completions route: lm-eval tokenises with the model's own tokenizer
    (``tokenizer_dir``) and sends token ids, so both backends score the very same ids."""
    args = {
        "model": model,
        "base_url": f"{base_url.rstrip('/')}/completions",
        "tokenizer": tokenizer_dir,
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,
        "num_concurrent": 4,
        "max_retries": 1,
    }
    return run("local-completions", args)


def hf(model_dir: str) -> Scores:
    """lm-eval's own forward of the same weights, in float32 on the CPU as lightq's CPU worker runs."""
    return run("hf", {"pretrained": model_dir, "dtype": "float32", "device": "cpu"}, batch_size=8)
