"""vllm-hotfix shim: runs in every Python process that has this directory on PYTHONPATH.

Stdlib only and never raises. It (1) installs a lazy trigger that activates the hotfix on
the first ``import vllm`` unless ``HOTFIX_DISABLE`` is set, and (2) chain-loads the next
``sitecustomize`` on ``sys.path`` (the image's own), which ours would otherwise shadow.
The chain-load also runs when the hotfix is disabled: turning us off must not turn off
somebody else's sitecustomize.
"""
import os
import sys

_DISABLE_ON = ("1", "true", "yes", "on")
_DISABLE_OFF = ("", "0", "false", "no", "off")


def _hotfix_disabled():
    raw = os.environ.get("HOTFIX_DISABLE", "")
    value = raw.strip().lower()
    if value in _DISABLE_ON:
        return True
    if value in _DISABLE_OFF:
        return False
    sys.stderr.write(
        "vllm-hotfix: HOTFIX_DISABLE=%r is not one of %s (disable) or %s (enable); "
        "treating it as disabled, since only the kill switch sets it\n"
        % (raw, "/".join(_DISABLE_ON), "/".join(v for v in _DISABLE_OFF if v))
    )
    return True


def _install_trigger(here):
    if _hotfix_disabled():
        return
    from hotfix import _bootstrap

    _bootstrap.install()


def _next_may_exist(here):
    """Cheap pre-check: a failing ``import sitecustomize`` lists every sys.path directory."""
    for entry in sys.path:
        base = os.path.abspath(entry or ".")
        if base == here:
            continue
        if not os.path.isdir(base):
            if os.path.exists(base):
                return True  # a zip or another importer: let the import system look
            continue
        for name in ("sitecustomize.py", "sitecustomize.pyc", "sitecustomize"):
            if os.path.exists(os.path.join(base, name)):
                return True
    return False


def _chain_load_next(here):
    """Import the next ``sitecustomize`` on sys.path (ddtrace's idiom), exactly once."""
    if not _next_may_exist(here):
        return
    ours = sys.modules.get("sitecustomize")
    ours_on_path = [(i, p) for i, p in enumerate(sys.path) if os.path.abspath(p or ".") == here]
    for index, _ in reversed(ours_on_path):
        del sys.path[index]
    sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401  (the next one, if any)
    except ImportError as exc:
        if exc.name != "sitecustomize":
            sys.stderr.write("vllm-hotfix: the next sitecustomize failed: %r\n" % (exc,))
        if ours is not None:
            sys.modules["sitecustomize"] = ours
    except BaseException as exc:  # a broken sitecustomize further down must not stop ours
        if isinstance(exc, KeyboardInterrupt):
            raise
        sys.stderr.write("vllm-hotfix: the next sitecustomize failed: %r\n" % (exc,))
        if ours is not None:
            sys.modules["sitecustomize"] = ours
    finally:
        for index, entry in ours_on_path:
            sys.path.insert(index, entry)


def _main():
    if getattr(sys, "_vllm_hotfix_shim_ran", False):
        return
    sys._vllm_hotfix_shim_ran = True
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        _install_trigger(here)
    except Exception as exc:
        sys.stderr.write("vllm-hotfix: not active (%s: %s)\n" % (type(exc).__name__, exc))
    try:
        _chain_load_next(here)
    except Exception as exc:
        sys.stderr.write("vllm-hotfix: chain-load failed (%s: %s)\n" % (type(exc).__name__, exc))


_main()
