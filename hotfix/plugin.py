"""``[vllm.general_plugins]`` entry point: the second way in, for every vLLM process.

vLLM calls ``register()`` in the API server, the EngineCore and each worker, before the
scheduler and connectors are imported, and does not catch what it raises: so we never
raise, except under ``HOTFIX_STRICT=1``. It covers pods where our ``sitecustomize`` is
shadowed by another injector's, and pip installs.
"""


def register() -> None:
    try:
        import hotfix

        hotfix.activate("vllm_plugin")
    except Exception as exc:
        from hotfix import config, log

        log.error("hotfix.activate.error", source="vllm_plugin", reason=f"{type(exc).__name__}: {exc}")
        if config.strict():
            raise
