"""Who a vLLM process is (model, engine index, rank), read from vLLM's own constructors.

Status records are summed per engine (``hotfix.metrics``); a process's multiprocessing name
says only its role. Three constructors that every release 0.27.0 ... 0.33.0 calls with the
same signature say the rest: ``EngineCore.__init__(vllm_config, ...)`` in each EngineCore,
``WorkerBase.__init__(vllm_config, local_rank, rank, ...)`` in each worker, and
``PrometheusStatLogger.__init__(vllm_config, engine_indexes)`` where vLLM sets up its own
Prometheus metrics (API-server processes), which is also where our collector goes in. The
observers change nothing: vLLM's constructor runs with its own arguments, and an observer
that fails logs one ERROR naming its target and leaves the record without identity (the
metrics then fall back to the role name), never raising into vLLM (except under
``HOTFIX_STRICT=1``). They are not fingerprinted as the fixes' targets are: they read the
arguments and change no behaviour, so a changed body cannot make them wrong, only a changed
signature, which they report.
"""
from __future__ import annotations

from hotfix import _deps, config, log, status
from hotfix.runtime import argument

ENGINE_CORE, WORKER, API_SERVER = "engine_core", "worker", "api_server"


def _config_fields(vllm_config) -> dict:
    return {"model_name": str(vllm_config.model_config.served_model_name),
            "engine": str(vllm_config.parallel_config.data_parallel_rank)}


def engine_core_is(wrapped, instance, args, kwargs):
    _observe(ENGINE_CORE, lambda: _config_fields(argument(args, kwargs, 0, "vllm_config")))
    return wrapped(*args, **kwargs)


def worker_is(wrapped, instance, args, kwargs):
    _observe(WORKER, lambda: {**_config_fields(argument(args, kwargs, 0, "vllm_config")),
                              "rank": int(argument(args, kwargs, 2, "rank")),
                              "local_rank": int(argument(args, kwargs, 1, "local_rank"))})
    return wrapped(*args, **kwargs)


def api_server_serves_prometheus(wrapped, instance, args, kwargs):
    """After vLLM registered its metrics (and unregistered stale ``vllm:`` ones), ours."""
    result = wrapped(*args, **kwargs)
    fields = _observe(API_SERVER, lambda: {
        "model_name": str(argument(args, kwargs, 0, "vllm_config").model_config.served_model_name)})
    if fields is not None:
        from hotfix import metrics

        metrics.install(fields["model_name"])
    return result


HOOKS = (
    ("vllm.v1.engine.core", "EngineCore.__init__", engine_core_is),
    ("vllm.v1.worker.worker_base", "WorkerBase.__init__", worker_is),
    ("vllm.v1.metrics.loggers", "PrometheusStatLogger.__init__", api_server_serves_prometheus),
)


def _observe(kind: str, read):
    try:
        fields = read()
        status.identify(kind=kind, **fields)
        return fields
    except Exception as exc:  # noqa: BLE001 - an observer never breaks vLLM's constructor
        log.once(("identity", kind), "error", "hotfix.identity.unreadable", kind=kind,
                 reason=f"{type(exc).__name__}: {exc}",
                 action="this process's status record carries no model/engine; metrics use its role")
        config.problem(f"identity ({kind}): {exc}", exc)
        return None


def install() -> None:
    """One post-import hook per observed module (it also fires for one imported already)."""
    wrapt = _deps.wrapt()
    for module_name, qualname, observer in HOOKS:
        wrapt.register_post_import_hook(_hook(qualname, observer), module_name)


def _hook(qualname: str, observer):
    def hook(module):
        try:
            _deps.wrapt().wrap_function_wrapper(module, qualname, observer)
        except Exception as exc:  # noqa: BLE001 - never break vLLM's import
            log.error("hotfix.identity.unavailable", target=f"{module.__name__}:{qualname}",
                      reason=f"{type(exc).__name__}: {exc}",
                      action="status records carry no identity from it; no hotfix metrics "
                      "if it is the Prometheus logger")
            config.problem(f"{module.__name__}:{qualname}: {exc}", exc)

    return hook
