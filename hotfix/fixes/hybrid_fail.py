"""hybrid-fail (D9): a failed NIXL READ on a hybrid KV cache is never reported as loaded.

On vLLM 0.27-0.29 NIXL's decode worker, when any KV-cache group is not full attention
(``_is_hma_required``: sliding window, hybrid/mamba models), handles a failed or declined READ
without reporting its blocks invalid ("TODO handle failed transfer for HMA"), and 0.27-0.29 have
no ``failed_recving``: the failed request is reported like a loaded one, the scheduler caches
and decodes over blocks nobody wrote (HTTP 200, wrong tokens) and later requests sharing the
prefix read them too. Every READ lease-guard declines on such a model ends the same way. And
the scheduler could not take the blocks if they were reported: its invalid-block path unpacks
one group (``(req_block_ids,) = ...``) and would raise. 0.30.0 reports the request in
``failed_recving`` instead (``_handle_failed_recving``), which is what this fix does on 0.27-0.29:
- worker side, where NIXL handles the failure: the request's blocks of every KV-cache group go
  to vLLM's own invalid-block channel (``get_block_ids_with_load_errors``), but only once the
  bound metadata showed the EngineCore runs this fix (its stamp): a stock EngineCore would
  crash on them;
- scheduler side, before ``update_from_output`` reads the step's output: invalid blocks on a
  KV cache with several groups are mapped to the requests that hold them (one block pool, so
  ids are unique across groups), taken out of the output, and the request is handled as 0.30
  handles a failed load: ``recompute`` from a computed-token count of 0 (vLLM frees its blocks,
  the retry gets fresh ones), ``fail`` with an error. Blocks are never cached.
The halves agree one way: the worker's part ships nothing of ours (vLLM's field, builtins) and
acts only on the EngineCore's stamp; the EngineCore's part alone acts only where stock vLLM
would raise. One patched rank is enough to fail the request.
"""
from __future__ import annotations

import dataclasses

from hotfix import log, status
from hotfix.fixes._scheduler_shapes import UPDATE_FROM_OUTPUT
from hotfix.halves import SchedulerHalf, WorkerHalf
from hotfix.runtime import argument, contain, state_of
from hotfix.registry import FIXED, LEAVE, FixSpec, Metric, Shape, Target

_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"

SPEC = FixSpec(
    id="hybrid-fail",
    toggle="HOTFIX_HYBRID_FAIL",
    title="a failed NIXL READ on a hybrid KV cache fails the request instead of decoding over "
    "unwritten blocks",
    defects=("D9",),
    targets=(
        # EngineCore: the stamp on NIXL's metadata, and the multi-group invalid blocks
        Target(f"{_NIXL}.base_scheduler", "NixlBaseConnectorScheduler.build_connector_meta",
               "stamp_the_scheduler_half", "engine_core",
               {"5e135d418e5f2cf1": Shape("0.27.0-0.28.0"), "8ca2f543bb825ebc": Shape("0.29.0"),
                "da785a694b3672f5": Shape("0.30.0-0.34.0", LEAVE)}),
        Target("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output",
               "fail_requests_over_invalid_hybrid_blocks", "engine_core",
               {fp: shape if shape.releases < "0.30" else Shape(shape.releases, LEAVE)
                for fp, shape in UPDATE_FROM_OUTPUT.items()}),
        # worker: where NIXL learns the step's metadata, and where it handles a failure
        Target(f"{_NIXL}.pull_worker", "NixlPullConnectorWorker.start_load_kv", "learn_the_stamp",
               "worker", {"8dbe3b73305be9d3": Shape("0.27.0-0.28.0"), "fbf01d2fbb377881": Shape("0.29.0"),
                          "d43b28a774241007": Shape("0.30.0", LEAVE), "7940533b664249eb": Shape("0.31.0", LEAVE),
                          "1277bc62dfb68d64": Shape("0.32.0-0.34.0", LEAVE)}),
        Target(f"{_NIXL}.base_worker", "NixlBaseConnectorWorker._handle_failed_transfer",
               "report_hybrid_blocks_invalid", "worker",
               {"50134fb19c89ff3c": Shape("0.27.0-0.29.0"),
                "9560b4fb1f2c26d3": Shape("0.30.0 (failed_recving)", FIXED),
                "73807639bc3b7812": Shape("0.31.0 (failed_recving)", FIXED),
                "c2634ba0a6c48177": Shape("0.32.0-0.34.0 (failed_recving)", FIXED)}),
    ),
    upstream="vllm-project/vllm 0.30.0 (failed_recving + Scheduler._handle_failed_recving)",
    remove_when="every vLLM release the fleet runs is 0.30.0 or newer",
    metrics=(
        Metric("vllm:hotfix_hybrid_failed_loads", "Failed READs on a hybrid KV cache reported as "
               "failed (stock 0.27-0.29 reports them as loaded: wrong tokens)",
               ("hybrid_failed_load",),
               alert="rate > 0: READs fail on a hybrid model (prefill gone, lease expired)"),
    ),
)

FIX = SPEC.id


# ---------------------------------------------------------------------------------------
# Scheduler side (EngineCore)
# ---------------------------------------------------------------------------------------

def stamp_the_scheduler_half(wrapped, instance, args, kwargs):
    """NIXL's metadata says the EngineCore takes invalid blocks of several groups."""
    metadata = wrapped(*args, **kwargs)
    try:
        state_of(instance, "_hotfix_hybrid_half", lambda: SchedulerHalf(FIX, 1)).stamp(metadata)
    except Exception as exc:
        contain(FIX, "NixlBaseConnectorScheduler.build_connector_meta", exc,
                fallback="no stamp this step (the workers report hybrid failures as stock)")
    return metadata


def fail_requests_over_invalid_hybrid_blocks(wrapped, instance, args, kwargs):
    """Invalid blocks on a KV cache with several groups: fail their requests as 0.30 does,
    and keep the blocks from vLLM's one-group path (where they would raise)."""
    try:
        output = argument(args, kwargs, 1, "model_runner_output")
        kv = output.kv_connector_output
        if kv is not None and kv.invalid_block_ids and len(instance.kv_cache_config.kv_cache_groups) > 1:
            kv = dataclasses.replace(kv, invalid_block_ids=set())
            _fail_holders(instance, set(output.kv_connector_output.invalid_block_ids))
            output = dataclasses.replace(output, kv_connector_output=kv)
            if "model_runner_output" in kwargs:
                kwargs = {**kwargs, "model_runner_output": output}
            else:
                args = args[:1] + (output,) + args[2:]
    except Exception as exc:
        contain(FIX, "Scheduler.update_from_output", exc, fallback="this step's output as sent")
    return wrapped(*args, **kwargs)


def _fail_holders(scheduler, invalid: set) -> None:
    from vllm.v1.request import RequestStatus

    for request in list(scheduler.requests.values()):
        if request.is_finished():
            continue
        held = {b for group in scheduler.kv_cache_manager.get_block_ids(request.request_id) for b in group}
        if not held & invalid:
            continue
        _count("hybrid_failed_load")
        loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        if loading and scheduler.recompute_kv_load_failures:
            request.num_computed_tokens = 0  # what 0.30's _handle_failed_recving does
            scheduler.failed_recving_kv_req_ids.add(request.request_id)
            action = "recompute"
        else:
            scheduler.grammar_compile_error_reqs.add(request.request_id)  # an error output
            action = "fail"
        log.limited((FIX, action), "warning", "hotfix.hybrid.failed_load", fix=FIX,
                    req_id=request.request_id, action=action,
                    reason="a KV load into a hybrid KV cache failed (blocks of several groups)")


# ---------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------

def learn_the_stamp(wrapped, instance, args, kwargs):
    """The step's metadata tells whether the EngineCore runs this fix."""
    try:
        state_of(instance, "_hotfix_hybrid_half", lambda: WorkerHalf(FIX)).bound(
            argument(args, kwargs, 0, "metadata"))
    except Exception as exc:
        contain(FIX, "NixlPullConnectorWorker.start_load_kv", exc,
                fallback="hybrid failures reported as stock")
    return wrapped(*args, **kwargs)


def report_hybrid_blocks_invalid(wrapped, instance, args, kwargs):
    """After NIXL handled a failure: on a hybrid cache, R's blocks of every group are invalid
    (stock reports none), so the scheduler fails R instead of caching unwritten blocks."""
    req_id = None
    try:
        req_id = argument(args, kwargs, 0, "req_id")
        meta = instance._recving_metadata.get(req_id)
    except Exception as exc:
        contain(FIX, "NixlBaseConnectorWorker._handle_failed_transfer", exc, fallback="stock report")
        return wrapped(*args, **kwargs)
    result = wrapped(*args, **kwargs)
    try:
        half = instance.__dict__.get("_hotfix_hybrid_half")
        if meta is not None and instance._is_hma_required and half is not None and half.may_ship:
            blocks = {b for group in meta.local_block_ids for b in
                      (group if isinstance(group, (list, tuple)) else (group,))}
            if blocks:
                instance._invalid_block_ids.put(blocks)
    except Exception as exc:
        contain(FIX, "NixlBaseConnectorWorker._handle_failed_transfer", exc,
                fallback=f"{req_id} reported as stock does (as loaded)")
    return result


def _count(kind: str) -> None:
    status.count(FIX, kind)
