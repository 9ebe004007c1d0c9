import argparse

from shared.config import RouterSettings
from shared.flags import add_flags, as_env, build, given
from shared.worker_settings import WorkerSettings


def parse(argv):
    parser = argparse.ArgumentParser()
    add_flags(parser, WorkerSettings)
    return given(parser.parse_args(argv))


def test_flags_keep_lightllm_names_and_env_fills_the_rest(monkeypatch):
    monkeypatch.setenv("LIGHTQ_RUNNING_MAX_REQ_SIZE", "7")
    flags = parse(["--max_total_token_num", "123", "--redis_url", "redis://h:1/2", "--model_dir", "m"])
    settings = build(WorkerSettings, flags)
    assert settings.max_total_token_num == 123
    assert settings.running_max_req_size == 7
    assert settings.redis.url == "redis://h:1/2"
    assert settings.model.model_dir == "m"


def test_given_flags_become_child_environment():
    env = as_env(parse(["--batch_max_tokens", "64", "--redis_key_prefix", "x"]))
    assert env == {"LIGHTQ_BATCH_MAX_TOKENS": "64", "LIGHTQ_REDIS_KEY_PREFIX": "x"}


def test_settings_are_frozen():
    settings = build(WorkerSettings, {})
    try:
        settings.tp = 2
    except Exception:
        return
    raise AssertionError("settings must be frozen")


def test_admission_flags_and_their_environment_reach_the_rule(monkeypatch):
    settings = build(RouterSettings, {"admission": "conservative", "admission_margin": 0.1})
    assert (settings.admission_rule.admission, settings.admission_rule.admission_margin) == ("conservative", 0.1)
    # a child process gets --admission as LIGHTQ_ADMISSION, which no settings field but the policy reads
    monkeypatch.setenv("LIGHTQ_ADMISSION", "aggressive")
    assert RouterSettings().admission_rule.admission == WorkerSettings().admission_rule.admission == "aggressive"
