"""The identity observers read vLLM's constructor arguments and never break the constructor:
an argument they cannot read, or a class they cannot find, is one ERROR naming it."""
from __future__ import annotations

import logging
from types import ModuleType, SimpleNamespace

import pytest

from hotfix import identity, metrics, status


def vllm_config(model="tiny", dp_rank=0):
    return SimpleNamespace(model_config=SimpleNamespace(served_model_name=model),
                           parallel_config=SimpleNamespace(data_parallel_rank=dp_rank))


@pytest.fixture
def identity_fields(monkeypatch):
    seen = {}
    monkeypatch.setattr(status, "identify", lambda **f: seen.update(f))
    return seen


def test_an_engine_core_and_a_worker_say_model_engine_and_rank(identity_fields):
    assert identity.engine_core_is(lambda *a, **k: "built", None, (vllm_config(dp_rank=1), "exec"), {}) == "built"
    assert identity_fields == {"kind": "engine_core", "model_name": "tiny", "engine": "1"}
    identity.worker_is(lambda *a, **k: None, None, (vllm_config(),), {"local_rank": 0, "rank": 3})
    assert identity_fields["rank"] == 3 and identity_fields["kind"] == "worker"


def test_an_unreadable_argument_is_one_error_and_the_constructor_still_runs(identity_fields, caplog):
    calls = []
    with caplog.at_level(logging.ERROR, logger="vllm.hotfix"):
        for _ in range(3):
            identity.worker_is(lambda *a, **k: calls.append(a), None, ("not a config",), {})
    assert calls == [("not a config",)] * 3 and identity_fields == {}
    assert sum("hotfix.identity.unreadable" in r.getMessage() for r in caplog.records) == 1


def test_the_api_servers_prometheus_logger_installs_the_collector_after_vllms_own(monkeypatch):
    order = []
    monkeypatch.setattr(status, "identify", lambda **f: None)
    monkeypatch.setattr(metrics, "install", lambda model: order.append(("install", model)))
    identity.api_server_serves_prometheus(lambda *a, **k: order.append("vllm"), None, (vllm_config("m"),), {})
    assert order == ["vllm", ("install", "m")]


def test_a_class_missing_from_its_module_is_one_error_naming_the_target(caplog):
    module = ModuleType("vllm.v1.engine.core")
    with caplog.at_level(logging.ERROR, logger="vllm.hotfix"):
        identity._hook("EngineCore.__init__", identity.engine_core_is)(module)
    (line,) = [r.getMessage() for r in caplog.records if "hotfix.identity.unavailable" in r.getMessage()]
    assert "vllm.v1.engine.core:EngineCore.__init__" in line


def test_under_strict_an_unreadable_argument_raises(identity_fields, monkeypatch):
    monkeypatch.setenv("HOTFIX_STRICT", "1")
    monkeypatch.setattr(identity.log, "once", lambda *a, **k: True)
    with pytest.raises(Exception, match="identity"):
        identity.worker_is(lambda *a, **k: None, None, ("not a config",), {})
