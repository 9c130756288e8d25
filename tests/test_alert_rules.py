"""The example alerting rules (hotfix/prometheus-alerts.yml) parse and name only series the
hotfix (or vLLM) exports. promtool is not on the package registries CI can reach, so its
``check rules`` is left to operators (docs/operating.md); these checks stand in for it."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from hotfix import registry

RULES = Path(__file__).resolve().parents[1] / "hotfix" / "prometheus-alerts.yml"
FRAMEWORK = {"vllm:hotfix_info", "vllm:hotfix_processes", "vllm:hotfix_fix_active",
             "vllm:hotfix_internal_errors_total"}
VLLM = {"vllm:num_requests_running", "vllm:num_requests_waiting"}


def exported() -> set[str]:
    names = set(FRAMEWORK)
    for spec in registry.discover():
        for metric in spec.metrics:
            names.add(metric.name if metric.gauge else f"{metric.name}_total")
    return names


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_every_rule_is_a_complete_alert_on_series_that_exist():
    found = rules()
    assert len(found) >= 8
    for rule in found:
        assert rule["alert"].startswith("Vllm") and rule["expr"].strip(), rule
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), rule
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule
        expr = rule["expr"]
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), rule
        for name in re.findall(r"vllm:[a-z_]+", expr):
            assert name in exported() | VLLM, (rule["alert"], name)


def test_every_declared_metric_has_an_alert_or_says_why_not():
    alerted = " ".join(rule["expr"] for rule in rules())
    for spec in registry.discover():
        for metric in spec.metrics:
            exposed = metric.name if metric.gauge else f"{metric.name}_total"
            assert exposed in alerted or not metric.alert, (spec.id, metric.name)
