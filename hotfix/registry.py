"""Fix specs as data; decide from the installed files; apply in post-import hooks.

A fix is an **atomic group** of targets ``(module, "Class.method")``. Whether it applies is
decided per process from the installed vLLM files alone (AST fingerprints), so the
EngineCore and every worker reach the same decision without talking to each other. The
wrappers go on in wrapt post-import hooks, which also fire for a module imported before
activation. A group that fails half-way is reverted in that process. Nothing in this
module knows about any particular fix: specs are discovered in ``hotfix.fixes``.
"""
from __future__ import annotations

import importlib
import pkgutil
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

from hotfix import forksafe, config, fingerprint, log, status

WRAP = "wrap"
LEAVE = "leave"  # a known shape that must not be wrapped (e.g. a shim that delegates)
FIXED = "fixed"  # a known shape that carries the upstream fix: nothing to wrap, nothing missing


@dataclass(frozen=True)
class Shape:
    """A known fingerprint of a target: which releases have it and what we do with it."""

    releases: str
    action: str = WRAP


@dataclass(frozen=True)
class Target:
    """One method a fix wraps, with the shapes it is known to have."""

    module: str
    qualname: str  # "Class.method"; methods on classes only (subclasses inherit the wrap)
    wrapper: str  # wrapt-style wrapper function in the fix's module; "" = shape check only
    role: str  # where it runs: "engine_core" or "worker"
    shapes: Mapping[str, Shape]  # fingerprint -> shape
    may_be_absent: bool = False  # e.g. a method that only newer releases have

    @property
    def key(self) -> str:
        return f"{self.module}:{self.qualname}"


@dataclass(frozen=True)
class Metric:
    """A Prometheus series a fix exports (``hotfix.metrics``), summed over an engine's
    processes from the status counters (or gauges) named in ``kinds``."""

    name: str  # as vLLM declares its own: "vllm:..." without "_total"
    help: str
    kinds: Tuple[str, ...]  # the fix's status counter kinds (gauge names) that feed it
    gauge: bool = False
    by_kind: bool = False  # one series per kind, labelled ``label``
    label: str = "kind"
    label_values: Tuple[str, ...] = ()  # the label's value per kind (default: the kind)

    def label_value(self, kind: str) -> str:
        return self.label_values[self.kinds.index(kind)] if self.label_values else kind
    alert: str = ""  # what an on-call alerts on with it (docs/operating.md, the metrics table)


@dataclass(frozen=True)
class FixSpec:
    """A fix, declared at the top of its module."""

    id: str
    toggle: str  # HOTFIX_* variable: on | off | force
    title: str
    defects: Tuple[str, ...]
    targets: Tuple[Target, ...]
    upstream: str  # the upstream issue/PR this stands in for
    remove_when: str  # the condition under which the fix is deleted
    metrics: Tuple[Metric, ...] = ()  # what it exports to vLLM's /metrics


@dataclass
class TargetDecision:
    target: Target
    path: Optional[str]
    found: Optional[str]  # fingerprint of the installed code; None when absent
    action: str  # wrap | leave | absent | missing | unknown
    matches: Optional[str] = None  # releases whose shape it has

    def as_dict(self) -> dict:
        return {
            "target": self.target.key,
            "role": self.target.role,
            "path": self.path,
            "found": self.found,
            "known": {fp: s.releases for fp, s in self.target.shapes.items()},
            "matches": self.matches,
            "action": self.action,
        }


@dataclass
class FixDecision:
    spec: FixSpec
    mode: str
    apply: bool
    reason: str  # known_shape | forced | fixed_upstream | disabled | fingerprint_mismatch |
    # target_missing | vllm_missing
    targets: List[TargetDecision] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "fix": self.spec.id,
            "toggle": f"{self.spec.toggle}={self.mode}",
            "apply": self.apply,
            "reason": self.reason,
            "defects": list(self.spec.defects),
            "upstream": self.spec.upstream,
            "remove_when": self.spec.remove_when,
            "targets": [t.as_dict() for t in self.targets],
        }

    def to_wrap(self) -> List[Target]:
        wanted = (WRAP, "unknown") if self.reason == "forced" else (WRAP,)
        return [t.target for t in self.targets if t.action in wanted and t.target.wrapper]


def _decide_target(target: Target) -> TargetDecision:
    path = fingerprint.module_file(target.module)
    if path is None:
        return TargetDecision(target, None, None, "missing")
    try:
        found = fingerprint.of_file(path, target.qualname)
    except (OSError, SyntaxError, ValueError) as exc:
        log.error("hotfix.patch.error", target=target.key, reason=f"unreadable: {exc}")
        return TargetDecision(target, path, None, "missing")
    if found is None:
        return TargetDecision(target, path, None, "absent" if target.may_be_absent else "missing")
    shape = target.shapes.get(found)
    if shape is None:
        return TargetDecision(target, path, found, "unknown")
    return TargetDecision(target, path, found, shape.action, shape.releases)


def decide(spec: FixSpec, mode: Optional[str] = None) -> FixDecision:
    """The decision for one fix, from the toggle and the installed files (no vLLM import)."""
    mode = mode or config.fix_mode(spec.toggle)
    targets = [_decide_target(t) for t in spec.targets]
    if fingerprint.package_root("vllm") is None:
        return FixDecision(spec, mode, False, "vllm_missing", targets)
    if mode == "off":
        return FixDecision(spec, mode, False, "disabled", targets)
    if any(t.action == "missing" for t in targets):
        return FixDecision(spec, mode, False, "target_missing", targets)
    if any(t.action == "unknown" for t in targets):
        if mode == "force":
            return FixDecision(spec, mode, True, "forced", targets)
        return FixDecision(spec, mode, False, "fingerprint_mismatch", targets)
    if not any(t.action == WRAP for t in targets):
        if any(t.action == FIXED for t in targets):  # this release has the fix itself
            return FixDecision(spec, mode, False, "fixed_upstream", targets)
        return FixDecision(spec, mode, False, "target_missing", targets)
    return FixDecision(spec, mode, True, "known_shape", targets)


def fix_modules(package: str = "hotfix.fixes") -> list:
    """Every module of ``package`` that declares a ``SPEC`` (importing one must not import vLLM)."""
    pkg = importlib.import_module(package)
    modules = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        if isinstance(getattr(module, "SPEC", None), FixSpec):
            modules.append(module)
    return modules


def discover(package: str = "hotfix.fixes") -> List[FixSpec]:
    return [m.SPEC for m in fix_modules(package)]




# --------------------------------------------------------------------------------------
# Application (one process)
# --------------------------------------------------------------------------------------

PENDING, APPLIED, SKIPPED, REVERTED = "pending", "applied", "skipped", "reverted"
#: reasons for not applying that need no operator action
NOT_A_PROBLEM = ("disabled", "vllm_missing", "fixed_upstream")


class _FixState:
    """What this process did with one fix: its decision and the wrappers it holds."""

    def __init__(self, spec: FixSpec, module) -> None:
        self.spec = spec
        self.module = module  # the fix's module, where the wrapper functions live
        self.decision: Optional[FixDecision] = None
        self.state = PENDING
        self.reason = ""
        self.handles: Dict[str, tuple] = {}  # target key -> (owner class, attr, wrapper)


class Activation:
    """The per-process registry: hooks registered, decisions taken, wrappers applied."""

    def __init__(self, source: str, modules: list) -> None:
        self.source = source
        self.fixes = {m.SPEC.id: _FixState(m.SPEC, m) for m in modules}
        self.lock = threading.RLock()
        forksafe.renew_in_child(self, "lock", threading.RLock)

    def modules(self) -> List[str]:
        return sorted({t.module for f in self.fixes.values() for t in f.spec.targets})

    def on_import(self, module_name: str, module) -> None:
        """Post-import hook body: never lets an error escape into vLLM's import."""
        for fix in list(self.fixes.values()):
            if not any(t.module == module_name for t in fix.spec.targets):
                continue
            try:
                with self.lock:
                    self._apply_in_module(fix, module_name, module)
            except BaseException as exc:  # noqa: B902 - a hook that raises breaks vLLM's import
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                undone = self._revert(fix, f"error: {type(exc).__name__}: {exc}")
                log.error("hotfix.patch.error", fix=fix.spec.id, target=module_name,
                          reason=f"{type(exc).__name__}: {exc}", reverted=undone,
                          action="fix reverted in this process; vLLM runs without it", exc_info=True)
                config.problem(f"{fix.spec.id}: {exc}", exc)
            _status_changed(self)

    def _decision(self, fix: _FixState) -> FixDecision:
        if fix.decision is None:
            fix.decision = decide(fix.spec)
            if not fix.decision.apply:
                fix.state, fix.reason = SKIPPED, fix.decision.reason
                _log_skip(fix.decision)
            elif fix.decision.reason == "forced":
                log.warning("hotfix.patch.forced", fix=fix.spec.id,
                            targets=[t.target.key for t in fix.decision.targets if t.action == "unknown"])
        return fix.decision

    def _apply_in_module(self, fix: _FixState, module_name: str, module) -> None:
        decision = self._decision(fix)
        if fix.state in (SKIPPED, REVERTED):
            return
        for target in decision.to_wrap():
            if target.module != module_name or target.key in fix.handles:
                continue
            expected = next(t.found for t in decision.targets if t.target is target)
            fix.handles[target.key] = _wrap(fix, target, module, expected)
            log.info("hotfix.patch.applied", fix=fix.spec.id, target=target.key,
                     fingerprint=expected, source=self.source)
        if all(t.key in fix.handles for t in decision.to_wrap()):
            fix.state, fix.reason = APPLIED, decision.reason

    def _revert(self, fix: _FixState, reason: str) -> list:
        """Undo every wrapper of a fix in this process (a group is all or nothing)."""
        undone = []
        for key, (owner, attr, wrapper) in list(fix.handles.items()):
            try:
                _require_wrapt().unwrap_object(owner, attr, wrapper)
                undone.append(key)
            except Exception as exc:
                log.error("hotfix.patch.error", fix=fix.spec.id, target=key,
                          reason=f"revert failed: {exc}")
            fix.handles.pop(key, None)
        fix.state, fix.reason = REVERTED, reason
        status.undegrade(fix.spec.id)
        return undone

    def apply_now(self) -> "Activation":
        """Import every target module and apply (tests, or a REPL on a live process)."""
        for name in self.modules():
            self.on_import(name, importlib.import_module(name))
        return self

    def revert_all(self, reason: str = "reverted on request") -> None:
        with self.lock:
            for fix in self.fixes.values():
                self._revert(fix, reason)
        if self is _activation:
            _status_changed(self)

    def snapshot(self) -> dict:
        with self.lock:
            return {
                fid: {"state": f.state, "reason": f.reason, "wrapped": sorted(f.handles)}
                for fid, f in self.fixes.items()
            }


def _require_wrapt():
    from hotfix import _deps

    wrapt = _deps.wrapt()
    if wrapt is None:
        raise ImportError("no usable wrapt (need >=2.4,<3): install it or use `hotfix bundle`")
    return wrapt


def _log_skip(decision: FixDecision) -> None:
    level = "info" if decision.reason in NOT_A_PROBLEM else "error"
    fields = {}
    if decision.reason == "fingerprint_mismatch":
        fields["mismatches"] = [
            {"target": t.target.key, "found": t.found, "expected": sorted(t.target.shapes)}
            for t in decision.targets if t.action == "unknown"
        ]
    if decision.reason == "target_missing":
        fields["missing"] = [t.target.key for t in decision.targets if t.action == "missing"]
    log.emit(level, "hotfix.patch.skipped", fix=decision.spec.id, reason=decision.reason, **fields)


def _wrap(fix: _FixState, target: Target, module, expected: Optional[str]) -> tuple:
    wrapt = _require_wrapt()
    *class_path, attr = target.qualname.split(".")
    owner = module
    for part in class_path:
        owner = getattr(owner, part)
    original = vars(owner).get(attr)
    if original is None:
        raise LookupError(f"{target.key} is not defined on {owner!r} itself")
    if wrapt.is_wrapped_by(original, predicate=lambda w: getattr(w, "_self_hotfix_fix", None) == fix.spec.id):
        return (owner, attr, original)  # already ours (a forked child, a second activation)
    live = fingerprint.of_function(original)
    if expected is not None and live != expected:
        raise LookupError(f"{target.key}: live code {live} differs from the file's {expected}")
    wrapper_function = getattr(fix.module, target.wrapper)

    def tagged_wrapper(wrapped, wrapper, fix_id):
        # A plain FunctionWrapper (a Python subclass would double the per-call cost);
        # `_self_` attributes live on the proxy itself.
        function_wrapper = wrapt.FunctionWrapper(wrapped, wrapper)
        function_wrapper._self_hotfix_fix = fix_id
        return function_wrapper

    wrapper = wrapt.wrap_object(owner, attr, tagged_wrapper, (wrapper_function, fix.spec.id))
    return (owner, attr, wrapper)


_activation: Optional[Activation] = None
status.write_records_of(lambda: _activation)  # status reads our activation, never imports us


def activation() -> Optional[Activation]:
    """This process's activation, or None if the hotfix was never activated here."""
    return _activation


def install_hooks(source: str, package: str = "hotfix.fixes") -> Activation:
    """Register one post-import hook per target module (called once, by ``activate``)."""
    global _activation
    wrapt = _require_wrapt()
    _activation = Activation(source, fix_modules(package))
    log.debug("hotfix.activate", source=source, fixes=sorted(_activation.fixes))
    for name in _activation.modules():
        wrapt.register_post_import_hook(_hook_for(_activation, name), name)
    _status_changed(_activation)
    return _activation


def _hook_for(act: Activation, module_name: str):
    def hook(module):
        act.on_import(module_name, module)

    return hook


def _status_changed(act: Activation) -> None:
    try:
        status.write(act)
    except Exception as exc:
        log.debug("hotfix.status.unwritten", reason=str(exc))
