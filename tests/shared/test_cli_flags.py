"""The command line (issue 14, item 9): switches with --no- forms, one default per flag,
--version, help grouped by settings class, LightLLM's flag names."""

from __future__ import annotations

import argparse

import pytest

from lightq.cli import main, parser
from shared.flags import add_flags, as_env, build, given
from shared.producer_settings import ProducerSettings
from shared.worker_settings import WorkerSettings


def parse(argv: list[str], settings_cls=WorkerSettings) -> dict:
    p = argparse.ArgumentParser()
    add_flags(p, settings_cls)
    return given(p.parse_args(argv))


def subcommand(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_on_off_settings_are_switches():
    assert parse(["--reject_without_workers"], ProducerSettings) == {"reject_without_workers": True}
    assert parse(["--no-reject_without_workers"], ProducerSettings) == {"reject_without_workers": False}
    assert parse([], ProducerSettings) == {}  # not given: the environment or the default decides
    assert build(WorkerSettings, parse(["--no-cuda_graphs"])).cuda_graphs is False


def test_lightllm_flag_names():
    flags = parse(
        [
            "--data_type",
            "bf16",
            "--disable_cudagraph",
            "--max_req_input_len",
            "100",
            "--tokenizer_mode",
            "fast",
            "--trust_remote_code",
            "--eos_id",
            "2",
            "7",
        ]
    )
    assert flags == {"dtype": "bfloat16", "cuda_graphs": False, "max_req_input_len": 100, "eos_id": [2, 7]}
    settings = build(WorkerSettings, flags)
    assert (settings.dtype, settings.cuda_graphs, settings.model.max_req_input_len, settings.eos_id) == (
        "bfloat16",
        False,
        100,
        [2, 7],
    )
    assert as_env({"eos_id": [2, 7]}) == {"LIGHTQ_EOS_ID": "[2, 7]"}  # a child reads it back as a list
    with pytest.raises(SystemExit):
        parse(["--tokenizer_mode", "slow"])
    with pytest.raises(SystemExit):
        parse(["--data_type", "int3"])


def test_a_child_reads_a_given_list_back(monkeypatch):
    for name, value in as_env(parse(["--eos_id", "2", "7", "--no-cuda_graphs"])).items():
        monkeypatch.setenv(name, value)
    settings = build(WorkerSettings, {})
    assert settings.eos_id == [2, 7] and settings.cuda_graphs is False


def test_help_is_grouped_with_one_default_each():
    serve = subcommand("serve")
    titles = {group.title: group for group in serve._action_groups}
    assert {
        "producer settings",
        "router settings",
        "worker settings",
        "redis settings",
        "model settings",
        "admission settings",
        "LightLLM's flag names",
    } <= set(titles)
    in_worker = {a.dest for a in titles["worker settings"]._group_actions}
    assert {"max_total_token_num", "cuda_graphs", "device"} <= in_worker
    for action in serve._actions:
        assert (action.help or "").count("default") <= 1, action.option_strings
    assert serve.format_help().count("\n  --max_total_token_num N") == 1  # listed once, though 3 classes share it


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("lightq ")


@pytest.mark.parametrize("module", ["router.main", "worker.main", "producer.main"])
def test_a_service_module_run_with_python_m_takes_its_flags(module):
    """``python -m router.main --help`` printed nothing and started a router on the default Redis
    (its ``main`` read the environment alone); each service module now takes the flags its
    ``lightq`` subcommand takes, and refuses a bad one before anything starts."""
    import subprocess
    import sys

    shown = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"usage: python -m {module}") and "--redis_url" in shown.stdout
    bad = subprocess.run([sys.executable, "-m", module, "--no_such_flag"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unrecognized arguments: --no_such_flag" in bad.stderr
