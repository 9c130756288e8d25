"""The P/D TP=2 world's rank order (``DelayedReadNixlConnector``): a lagging rank counts its
lag only once rank 0 reported the request, and goes on alone once rank 0 has not reported in
``RANK_0_REPORT_WAIT_S`` (a rank 0 whose READ failed must not hang the world)."""
from __future__ import annotations

import importlib
import time

import pytest

from hotfix.worlds.pd_world import HERE


@pytest.fixture
def pd_connectors(monkeypatch):
    """The module the engines import (from HERE, as they do); sys.path is restored after."""
    monkeypatch.syspath_prepend(str(HERE))
    return importlib.import_module("pd_connectors")


def lagging_rank(pd_connectors, reports_dir):
    rank = object.__new__(pd_connectors.DelayedReadNixlConnector)  # the worker side's state only
    rank._rank, rank._rank_reports = 1, reports_dir
    return rank


def test_a_lagging_rank_waits_for_rank_0s_report_then_counts_its_lag(pd_connectors, tmp_path):
    rank = lagging_rank(pd_connectors, tmp_path)
    assert not rank._rank_0_reported("req-1", since=time.monotonic())
    (tmp_path / "req-1").touch()  # what rank 0's report writes
    assert rank._rank_0_reported("req-1", since=time.monotonic())


def test_a_lagging_rank_goes_on_alone_when_rank_0_never_reports(pd_connectors, tmp_path, monkeypatch):
    monkeypatch.setattr(pd_connectors, "RANK_0_REPORT_WAIT_S", 0.05)
    rank = lagging_rank(pd_connectors, tmp_path)
    due = time.monotonic()
    assert not rank._rank_0_reported("req-2", since=due)
    time.sleep(0.1)
    assert rank._rank_0_reported("req-2", since=due)
