"""wrapt and structlog: the image's own copy if it is suitable, else our private one.

``python -m hotfix bundle`` installs private copies into ``hotfix/_vendor/``. They must never
shadow the image's packages:
- wrapt is loaded under the private name ``hotfix._vendor.wrapt`` (its modules import each
  other relatively), in pure Python, because its C extension imports ``wrapt.*`` by absolute
  name and would mix with the image's older copy;
- structlog imports itself by absolute name, so the vendor directory is *appended* to
  ``sys.path`` only when the image has no structlog at all; with an unsuitable one we log
  through plain stdlib lines instead.
"""
from __future__ import annotations

import importlib
import os
import sys
import threading

from hotfix import forksafe

VENDOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_vendor")
_ACCEPTS = {
    # 2.2.0 broke C-descriptor wrapping; <2.4 lacks unwrap_object/is_wrapped_by.
    "wrapt": lambda v: (2, 4) <= v[:2] and v[0] < 3,
    "structlog": lambda v: v[:1] >= (22,),
}
_cache = {}
_lock = threading.Lock()
forksafe.renew_in_child(sys.modules[__name__], "_lock")


def _version_tuple(text) -> tuple:
    parts = []
    for piece in str(text).split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or (0,)


def _image_copy(name: str):
    """(module or None, present): the image's own copy, if it is suitable."""
    try:
        module = importlib.import_module(name)
    except ImportError:
        return None, False
    return (module if _ACCEPTS[name](_version_tuple(getattr(module, "__version__", "0"))) else None), True


def _private_wrapt():
    previous = os.environ.get("WRAPT_DISABLE_EXTENSIONS")
    os.environ["WRAPT_DISABLE_EXTENSIONS"] = "1"
    try:
        return importlib.import_module("hotfix._vendor.wrapt")
    finally:
        if previous is None:
            os.environ.pop("WRAPT_DISABLE_EXTENSIONS", None)
        else:
            os.environ["WRAPT_DISABLE_EXTENSIONS"] = previous


def _private_structlog(image_has_one: bool):
    if image_has_one or not os.path.isdir(os.path.join(VENDOR, "structlog")):
        return None
    if VENDOR not in sys.path:
        sys.path.append(VENDOR)
    return importlib.import_module("structlog")


def _load(name: str):
    with _lock:
        if name in _cache:
            return _cache[name]
        module, present = _image_copy(name)
        if module is None:
            try:
                module = _private_wrapt() if name == "wrapt" else _private_structlog(present)
            except ImportError:
                module = None
        _cache[name] = module
        return module


def wrapt():
    """The wrapt module to patch with; None when neither copy is usable."""
    return _load("wrapt")


def structlog():
    """The structlog module to log with; None means plain stdlib lines."""
    return _load("structlog")


def origin(name: str) -> str:
    """``image``, ``private`` or ``missing``: where the copy we use comes from."""
    module = _load(name)
    if module is None:
        return "missing"
    path = os.path.abspath(getattr(module, "__file__", "") or "")
    return "private" if path.startswith(VENDOR + os.sep) else "image"
