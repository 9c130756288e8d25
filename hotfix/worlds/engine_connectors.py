"""MultiConnector children for the engine world, loaded by vLLM itself in its own processes.

vLLM imports this module by ``kv_connector_module_path`` in the EngineCore (scheduler side)
and in the worker (worker side), so nothing here may rely on state shared with the test:
each child reads its settings from its own ``kv_connector_extra_config`` (built by
``engine_world``), and the worker side counts its steps itself (one ``get_finished`` call per
engine step). The engine world copies this file and ``without_hotfix.py`` into a directory of
their own and puts it on the engines' ``PYTHONPATH``, so a stock engine imports nothing else of
ours.

The pair models the bug report's decode node (``vllm-targets.md`` §0.2):

* ``SlowLoader`` — listed first, NIXL-like: claims the whole prompt as an async external
  hit for a request whose ``kv_transfer_params`` carry the ``remote_marker``, so MultiConnector
  chooses it; its metadata has NIXL's shape (``reqs_to_recv[req].local_block_ids``); the
  worker reports the load ``load_steps`` steps after starting it, and not before
  ``load_s`` seconds have passed (default 0: a real pull takes seconds whatever the step
  rate; against a real second connector, whose retrieve takes real time, only seconds order
  the two reports).
* ``FastLoader`` — LMCache-MP-like with the <= 0.5.4 bug: it also sees a hit, is given
  ``num_external_tokens=0`` by MultiConnector, retrieves anyway (metadata ``.requests`` of
  ops with ``.request_id`` and ``.direction == "RETRIEVE"``, the shape the hotfix
  recognises), and reports after ``load_steps`` (default 1).

Neither writes KV: the race is in who reports completion when, not in the bytes.
A ``load_steps`` count includes the step the load starts in: 1 reports in that same step.

With ``report_dir`` in its extra config, each instance writes one JSON record of the
process it was built in (role, pid, spawned or forked, hotfix activation and which
MultiConnector methods carry a hotfix wrapper), for the test to check from outside.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from without_hotfix import drop_hotfix_if_asked


@dataclass
class PullRequest:
    local_block_ids: list[int]


@dataclass
class PullMetadata(KVConnectorMetadata):
    reqs_to_recv: dict[str, PullRequest] = field(default_factory=dict)


@dataclass
class CacheOp:
    request_id: str
    direction: str
    block_ids: list[int]


@dataclass
class CacheMetadata(KVConnectorMetadata):
    requests: list[CacheOp] = field(default_factory=list)


class _Child(KVConnectorBase_V1, SupportsHMA):
    """Shared plumbing: the remote-hit lookup (scheduler side) and step-counted loads (worker)."""

    default_load_steps = 1

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.load_steps = int(extra.get("load_steps", self.default_load_steps))
        self.load_s = float(extra.get("load_s", 0.0))
        self.rank = _tp_rank() if role == KVConnectorRole.WORKER else None
        by_rank = extra.get("load_steps_by_rank") or {}
        if self.rank is not None and str(self.rank) in by_rank:
            self.load_steps = int(by_rank[str(self.rank)])  # TP: this rank reports later
        # scheduler: the most steps any rank takes, to see a compute before every rank loaded
        self.slowest_rank_steps = max([self.load_steps, *map(int, by_rank.values())])
        self.report_dir = extra.get("report_dir")
        self.remote_tokens = int(extra.get("remote_tokens", 0))
        self.remote_marker = extra["remote_marker"]
        self._served: set[str] = set()  # scheduler: requests whose hit was acted on
        self._steps_left: dict[str, int] = {}  # worker: loads in flight
        self._not_before: dict[str, float] = {}  # worker: when each may report (monotonic)
        drop_hotfix_if_asked(extra, role == KVConnectorRole.SCHEDULER)
        if self.report_dir:
            _write_record(self.report_dir, type(self).__name__, role, self.rank)

    # Scheduler side.
    def _has_remote_kv(self, request) -> bool:
        """A marked request's prompt is remote until this child acted on it (NIXL-style)."""
        params = request.kv_transfer_params or {}
        return bool(params.get(self.remote_marker)) and request.request_id not in self._served

    def _remote_hit(self, request, num_computed_tokens: int) -> int:
        """The rest of the prompt, or the first ``remote_tokens`` of it when the extra config
        says so (to claim exactly what a real cache beside it holds)."""
        if not self._has_remote_kv(request):
            return 0
        end = min(len(request.prompt_token_ids), self.remote_tokens or len(request.prompt_token_ids))
        return max(0, end - num_computed_tokens)

    def request_finished_all_groups(self, request, block_ids):
        self._served.discard(request.request_id)
        return False, None

    def request_finished(self, request, block_ids):
        return self.request_finished_all_groups(request, (block_ids,))

    # Worker side.
    def _start(self, req_id: str) -> None:
        self._steps_left[req_id] = self.load_steps
        self._not_before[req_id] = time.monotonic() + self.load_s

    def get_finished(self, finished_req_ids):
        done = set()
        now = time.monotonic()
        for req_id in list(self._steps_left):
            self._steps_left[req_id] -= 1
            if self._steps_left[req_id] <= 0 and now >= self._not_before[req_id]:
                del self._steps_left[req_id], self._not_before[req_id]
                done.add(req_id)
        return None, (done or None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def wait_for_save(self) -> None:
        return


class SlowLoader(_Child):
    """NIXL-like: the chosen loader, honest about ``num_external_tokens``, slow to finish."""

    default_load_steps = 6

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._to_recv: dict[str, PullRequest] = {}
        self._step = 0  # scheduler: build_connector_meta calls, one per engine step
        self._loading_since: dict[str, int] = {}  # scheduler: the step each load started in

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        hit = self._remote_hit(request, num_computed_tokens)
        return (hit, True) if hit > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._served.add(request.request_id)
            self._to_recv[request.request_id] = PullRequest(list(blocks.get_block_ids()[0]))
            self._loading_since[request.request_id] = self._step

    def build_connector_meta(self, scheduler_output) -> PullMetadata:
        """Also notes a request computed before its slowest rank can have reported its load:
        a load started in step s reports in step s + n - 1 on a rank counting n steps, so the
        scheduler can hear every rank only after step s + max(n) - 1."""
        for req_id in list(self._loading_since):
            if req_id in scheduler_output.num_scheduled_tokens:
                started = self._loading_since.pop(req_id)
                if self._step < started + self.slowest_rank_steps and self.report_dir:
                    _note_early_compute(self.report_dir, req_id, started, self._step)
        self._step += 1
        metadata, self._to_recv = PullMetadata(self._to_recv), {}
        return metadata

    def start_load_kv(self, forward_context, **kwargs) -> None:
        metadata = self._get_connector_metadata()
        for req_id, pull in metadata.reqs_to_recv.items():
            if pull.local_block_ids:
                self._start(req_id)


class FastLoader(_Child):
    """Buggy LMCache-MP-like: retrieves its own hit although MultiConnector gave it 0 tokens."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._ops: list[CacheOp] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        hit = self._remote_hit(request, num_computed_tokens)
        return (hit, True) if hit > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        # The bug: whether to retrieve ignores num_external_tokens (lmcache <= 0.5.4).
        if self._has_remote_kv(request):
            self._served.add(request.request_id)
            self._ops.append(CacheOp(request.request_id, "RETRIEVE", list(blocks.get_block_ids()[0])))

    def build_connector_meta(self, scheduler_output) -> CacheMetadata:
        metadata, self._ops = CacheMetadata(self._ops), []
        return metadata

    def start_load_kv(self, forward_context, **kwargs) -> None:
        for op in self._get_connector_metadata().requests:
            if op.direction == "RETRIEVE":
                self._start(op.request_id)


_WATCHED = {  # module -> (class, methods) whose hotfix wrappers a record lists
    "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector": (
        "MultiConnector", ("update_state_after_alloc", "build_connector_meta",
                           "bind_connector_metadata", "get_finished", "get_transfer_results")),
    "vllm.v1.core.sched.scheduler": ("Scheduler", ("_update_from_kv_xfer_finished",)),
}


def _role_name(role: KVConnectorRole) -> str:
    return "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def _note_early_compute(report_dir: str, req_id: str, load_started: int, computed: int) -> None:
    with open(os.path.join(report_dir, "computed-while-loading.jsonl"), "a") as fh:
        fh.write(json.dumps({"request": req_id, "load_started_step": load_started,
                             "computed_step": computed}) + "\n")


def _write_record(report_dir: str, connector: str, role: KVConnectorRole, rank: int | None) -> None:
    hotfix = sys.modules.get("hotfix")
    main = sys.modules.get("__main__")
    record = {
        "connector": connector,
        "role": _role_name(role),
        "rank": rank,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "spawned": getattr(main, "__name__", None) == "__mp_main__",
        "hotfix_activated_by": getattr(hotfix, "activated_by", None),
        "wrapped": _wrapped(),
    }
    path = os.path.join(report_dir, f"{record['role']}-{connector}-{os.getpid()}.json")
    with open(path, "w") as fh:
        json.dump(record, fh)


def _wrapped() -> dict[str, list[str]]:
    """``"Class.method" -> fixes`` for the watched methods of the modules loaded here."""
    found = {}
    for module_name, (class_name, methods) in _WATCHED.items():
        module = sys.modules.get(module_name)
        if module is None:
            continue
        owner = vars(getattr(module, class_name))
        for method in methods:
            if method in owner:
                found[f"{class_name}.{method}"] = _fix_ids(owner[method])
    return found


def _fix_ids(function) -> list[str]:
    """The hotfix fixes wrapped around ``function``, outermost first."""
    found = []
    while function is not None:
        if getattr(function, "_self_hotfix_fix", None):
            found.append(function._self_hotfix_fix)
        function = getattr(function, "__wrapped__", None)
    return found
