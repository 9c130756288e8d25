"""The real LMCache server runs on a CPU-only machine and leaves nothing behind (lmcache 0.5.4):
no process of its group, no LMCache entry in /dev/shm."""
from __future__ import annotations

import os

import pytest

from conftest import clean_env, require_release
from hotfix.worlds.lmcache_server import LMCacheServer


def test_the_real_lmcache_server_answers_then_stops_with_its_process_group_and_leaves_no_shm(tmp_path):
    release = require_release("0.5.4")
    with LMCacheServer(release, tmp_path / "lmcache.log", clean_env()) as server:
        assert server.healthy()
        assert "cache server is running" in server.log_tail()
        pid = server.process.pid
    assert not server.healthy()
    assert server.leftovers() == []  # LMCache's /dev/shm entries created since it started
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
