"""Config parsing and logging, in-process (no vLLM needed)."""
from __future__ import annotations

import json
import logging

import pytest

from hotfix import config, log


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    for var in ("HOTFIX_STRICT", "HOTFIX_LOG_FORMAT", "HOTFIX_X"):
        monkeypatch.delenv(var, raising=False)
    config._reported.clear()
    monkeypatch.setattr(log, "_bound", None)
    log.reset_rate_limits()


def hotfix_records(caplog):
    return [r for r in caplog.records if r.name == "vllm.hotfix"]


def test_modes_are_parsed_case_insensitively(monkeypatch):
    monkeypatch.setenv("HOTFIX_X", " Force ")
    assert config.fix_mode("HOTFIX_X") == "force"
    monkeypatch.setenv("HOTFIX_X", "")
    assert config.fix_mode("HOTFIX_X") == "on"


def test_bad_value_logs_one_error_naming_variable_value_accepted_and_default(monkeypatch, caplog):
    monkeypatch.setenv("HOTFIX_X", "sometimes")
    caplog.set_level(logging.DEBUG)
    assert config.fix_mode("HOTFIX_X") == "on"
    assert config.fix_mode("HOTFIX_X") == "on"
    (record,) = hotfix_records(caplog)
    assert record.levelno == logging.ERROR
    for needle in ("HOTFIX_X", "'sometimes'", "'on', 'off', 'force'", "default on"):
        assert needle in record.getMessage()


def test_bad_value_raises_under_strict(monkeypatch):
    monkeypatch.setenv("HOTFIX_X", "sometimes")
    monkeypatch.setenv("HOTFIX_STRICT", "1")
    with pytest.raises(config.ConfigError, match="HOTFIX_X"):
        config.fix_mode("HOTFIX_X")


def test_bad_strict_value_is_reported_and_means_not_strict(monkeypatch, caplog):
    monkeypatch.setenv("HOTFIX_STRICT", "always")
    assert config.strict() is False
    assert "HOTFIX_STRICT" in hotfix_records(caplog)[0].getMessage()


def test_logging_never_configures_global_logging_or_structlog(caplog):
    import structlog

    root_handlers = list(logging.getLogger().handlers)
    log.error("hotfix.test", fix="x", req_id="r1")
    assert list(logging.getLogger().handlers) == root_handlers
    assert structlog.is_configured() is False
    message = hotfix_records(caplog)[0].getMessage()
    for needle in ("event='hotfix.test'", "req_id='r1'", "pid=", "role=", "hotfix_version="):
        assert needle in message


def test_json_format_renders_one_json_object(monkeypatch, caplog):
    monkeypatch.setenv("HOTFIX_LOG_FORMAT", "json")
    log.warning("hotfix.test", fix="x")
    data = json.loads(hotfix_records(caplog)[0].getMessage())
    assert data["event"] == "hotfix.test" and data["level"] == "warning" and data["fix"] == "x"


def test_rate_limited_repeats_are_counted_not_printed(monkeypatch, caplog):
    clock = [100.0]
    monkeypatch.setattr(log.time, "monotonic", lambda: clock[0])
    for _ in range(5):
        log.limited(("k",), "error", "hotfix.test.repeat")
    clock[0] += log.RATE_LIMIT_S + 1
    log.limited(("k",), "error", "hotfix.test.repeat")
    records = hotfix_records(caplog)
    assert len(records) == 2 and "suppressed=4" in records[1].getMessage()
