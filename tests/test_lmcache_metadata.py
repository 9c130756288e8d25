"""recv-barrier reads the metadata of the LMCache MP connector that really runs (lmcache 0.5.4,
0.5.6), not only the worlds' doubles of it.

vLLM resolves ``LMCacheMPConnector`` to LMCache's own class when the lmcache package ships one
("Using external LMCacheMPConnector"); vLLM's in-tree copy, which the doubles were modelled on,
then never runs. Each release is imported in its own interpreter with only that release on the
path, as an engine would load it; the metadata is built from its real classes the way its
scheduler side does (``add_request_metadata`` of ``LMCacheMPRequestMetadata`` ops). CI installs
both releases ``--no-deps`` under ``$VENV/lmcache/<version>`` (``.ci/leg.sh``), outside
site-packages, so no other test's vLLM sees LMCache.
"""
from __future__ import annotations

import pytest

from conftest import REPO, last_json, require_release, run_py

PROBE = """
import json, sys
sys.path.insert(0, {repo!r})  # after start-up: our sitecustomize does not run, nothing is patched
from vllm.distributed.kv_transfer.kv_connector.v1 import lmcache_mp_connector as in_tree
from lmcache.integration.vllm.lmcache_mp_metadata import (LMCacheMPConnectorMetadata,
                                                          LMCacheMPRequestMetadata)
from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp
from hotfix.fixes.recv_barrier import loads_started

def op(req_id, direction, blocks):
    return LMCacheMPRequestMetadata(request_id=req_id, direction=direction, op=LoadStoreOp(
        token_ids=list(range(512)), block_ids=[blocks], start=0, end=256))

metadata = LMCacheMPConnectorMetadata()
metadata.add_request_metadata(op("R", "RETRIEVE", [1, 2, 3]))
metadata.add_request_metadata(op("S", "STORE", [4, 5]))
runs = in_tree.LMCacheMPConnector
print(json.dumps({{"runs": runs.__module__ + ":" + runs.__qualname__,
                  "metadata": type(metadata).__module__ + ":" + type(metadata).__qualname__,
                  "loads_started": sorted(loads_started(metadata))}}))
"""


@pytest.mark.parametrize("version", ["0.5.4", "0.5.6"])
def test_a_real_lmcache_retrieve_is_seen_as_a_load_and_a_store_is_not(version):
    release = require_release(version)
    seen = last_json(run_py(PROBE.format(repo=str(REPO)), path=[release], timeout=180))
    assert seen == {
        "runs": "lmcache.integration.vllm.lmcache_mp_connector:LMCacheMPConnector",
        "metadata": "lmcache.integration.vllm.lmcache_mp_metadata:LMCacheMPConnectorMetadata",
        "loads_started": ["R"],
    }
