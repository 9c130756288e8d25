"""``python -m hotfix status | bundle | repro | shapes``: operator and maintainer commands.

``status`` is static: it reads the installed files and the environment and never imports
vLLM or torch, so it can serve as a container readiness gate (exit 1 when an enabled fix
would not apply, or when nothing would inject the hotfix).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import hotfix
from hotfix import config, fingerprint, registry
from hotfix.dist_info import PLUGIN, PLUGIN_GROUP, write_dist_info

APPLYING = ("known_shape", "forced")
FINE = APPLYING + ("fixed_upstream",)  # the installed vLLM needs no patch for that fix


def _home() -> str:
    """The directory holding ``hotfix/`` (a checkout, a bundle, or site-packages)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(hotfix.__file__)))


def _sitecustomizes() -> list:
    """Every sitecustomize on sys.path, in import order, each file once."""
    found = []
    for entry in sys.path:
        base = os.path.abspath(entry or ".")
        for candidate in (os.path.join(base, "sitecustomize.py"),
                          os.path.join(base, "sitecustomize", "__init__.py")):
            if os.path.isfile(candidate):
                if candidate not in found:
                    found.append(candidate)
                break
    return found


def injection_report() -> dict:
    from importlib import metadata

    home = _home()
    ours = os.path.join(home, "sitecustomize.py")
    chain = _sitecustomizes()
    ours_on_path = ours in chain
    index = chain.index(ours) if ours_on_path else None
    allow = os.environ.get("VLLM_PLUGINS")
    allowed = allow is None or PLUGIN in [p.strip() for p in allow.split(",")]
    eps = [ep for ep in metadata.entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN]
    return {
        "hotfix_dir": home,
        "disabled": os.environ.get("HOTFIX_DISABLE", "").strip().lower() not in ("", "0", "false", "no", "off"),
        "sitecustomize": {
            "ours": ours if ours_on_path else None,
            "ahead_of_ours": chain[:index] if ours_on_path else [],
            "chain_loads_next": chain[index + 1] if ours_on_path and index + 1 < len(chain) else None,
        },
        "plugin": {
            "entry_point": [ep.value for ep in eps],
            "vllm_plugins": allow,
            "excluded_by_vllm_plugins": not allowed,
        },
        "deps": {name: _dep(name) for name in ("wrapt", "structlog")},
    }


def _dep(name: str) -> dict:
    from hotfix import _deps

    module = getattr(_deps, name)()
    return {"origin": _deps.origin(name), "version": getattr(module, "__version__", None)}


def _injected(inj: dict) -> bool:
    site_ok = inj["sitecustomize"]["ours"] is not None and not inj["sitecustomize"]["ahead_of_ours"]
    plugin_ok = bool(inj["plugin"]["entry_point"]) and not inj["plugin"]["excluded_by_vllm_plugins"]
    return site_ok or plugin_ok


def status_report() -> dict:
    decisions = [registry.decide(spec) for spec in registry.discover()]
    inj = injection_report()
    problems = [
        f"{d.spec.id}: {d.reason}" for d in decisions if d.mode != "off" and d.reason not in FINE
    ]
    if decisions and not inj["disabled"] and not _injected(inj):
        problems.append("injection: neither our sitecustomize (first on sys.path) nor the "
                        "vllm.general_plugins entry point would run")
    if any(d["origin"] == "missing" for d in inj["deps"].values()):
        problems.append("deps: wrapt>=2.4,<3 and structlog are needed (install or `hotfix bundle`)")
    return {
        "hotfix_version": hotfix.__version__,
        "vllm": {"version": fingerprint.vllm_version(), "path": fingerprint.package_root("vllm")},
        "strict": config.strict(),
        "fixes": [d.as_dict() for d in decisions],
        "injection": inj,
        "problems": problems,
        "ready": not problems,
    }


def _print_status(report: dict) -> None:
    vllm = report["vllm"]
    print(f"vllm-hotfix {report['hotfix_version']}")
    print(f"vLLM {vllm['version'] or 'not installed'} at {vllm['path']}")
    for fix in report["fixes"]:
        verdict = "APPLY" if fix["apply"] else "SKIP"
        print(f"\n[{verdict}] {fix['fix']} ({fix['toggle']}): {fix['reason']}  "
              f"defects={','.join(fix['defects'])}")
        for t in fix["targets"]:
            known = ", ".join(f"{fp} ({rel})" for fp, rel in t["known"].items())
            print(f"  {t['target']} [{t['role']}]: {t['action']}; found={t['found']}"
                  f" matches={t['matches']}\n      known: {known}")
    inj = report["injection"]
    site = inj["sitecustomize"]
    print(f"\nHOTFIX_DISABLE: {'set, nothing is patched' if inj['disabled'] else 'not set'}")
    print(f"sitecustomize: ours={site['ours']}; ahead of ours={site['ahead_of_ours'] or 'none'};"
          f" chain-loads next={site['chain_loads_next']}")
    plugin = inj["plugin"]
    print(f"vllm plugin: entry point={plugin['entry_point'] or 'not found'};"
          f" VLLM_PLUGINS={plugin['vllm_plugins']!r}"
          f"{' EXCLUDES hotfix' if plugin['excluded_by_vllm_plugins'] else ''}")
    for name, dep in inj["deps"].items():
        print(f"{name}: {dep['version']} ({dep['origin']})")
    print("\nready" if report["ready"] else "\nNOT READY:\n  " + "\n  ".join(report["problems"]))


def _status_dirs() -> list:
    """``HOTFIX_STATUS_DIR``, else every vLLM instance's directory (never creates one)."""
    from hotfix import status

    explicit = os.environ.get("HOTFIX_STATUS_DIR")
    if explicit:
        return [explicit]
    root = status.instance_root()
    try:
        return sorted(os.path.join(root, n) for n in os.listdir(root)
                      if os.path.isdir(os.path.join(root, n)))
    except OSError:
        return []


NOT_ACTING = ("degraded", "skipped", "reverted")


def runtime_report() -> dict:
    """Per instance: every process's record state and, per engine, the totals /metrics shows."""
    from hotfix import metrics, status

    instances = []
    for directory in _status_dirs():
        records = status.read_all(directory)
        processes = [{
            "pid": r["pid"], "role": r.get("role"), "kind": r.get("identity", {}).get("kind"),
            "engine": r.get("engine"), "rank": r.get("rank"),
            "alive": "exited" if r.get("exited_at") else ("yes" if status.pid_alive(r["pid"]) else "dead"),
            "fixes": {fix: f.get("state") for fix, f in sorted(r.get("fixes", {}).items())},
            # why a fix is not acting in that process, e.g. the half a partial rollout missed
            "reasons": {fix: f["reason"] for fix, f in sorted(r.get("fixes", {}).items())
                        if f.get("state") in NOT_ACTING and f.get("reason")},
        } for r in records]
        engines = [metrics.engine_summary(v) for v in metrics.engine_views(records)]
        instances.append({"directory": directory, "processes": processes, "engines": engines})
    return {"instances": instances}


def _print_runtime(report: dict) -> None:
    if not report["instances"]:
        print("no status records (no vLLM process with the hotfix has run here)")
    for inst in report["instances"]:
        print(f"== {inst['directory']}")
        for p in inst["processes"]:
            print(f"  pid {p['pid']} {p['role']} engine={p['engine']} rank={p['rank']} "
                  f"alive={p['alive']}: " + ", ".join(f"{k}={v}" for k, v in p["fixes"].items()))
            for fix, reason in p["reasons"].items():
                print(f"    {fix} {p['fixes'][fix]}: {reason}")
        for e in inst["engines"]:
            print(f"  engine {e['engine']} ({e['model_name']}), {e['processes']} live processes:")
            for fix, f in e["fixes"].items():
                errors = e["internal_errors"][fix]
                print(f"    {fix}: {'ACTIVE' if f['active'] else 'NOT ACTIVE'} ({f['state']}, "
                      f"{f['reason']}){f'; {errors} internal errors' if errors else ''}")
            for name, value in e["series"].items():
                print(f"    {name} = {value}")


def cmd_status(args) -> int:
    if args.runtime:
        report = runtime_report()
        if args.json:
            print(json.dumps(report, indent=2, sort_keys=True))
        else:
            _print_runtime(report)
        return 0
    report = status_report()
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        _print_status(report)
    return 0 if report["ready"] else 1


def cmd_bundle(args) -> int:
    """Lay out DIR for ``PYTHONPATH=DIR``: shim, package, plugin metadata, private deps."""
    home = _home()
    shim = os.path.join(home, "sitecustomize.py")
    if not os.path.isfile(shim):
        print(f"bundle: {shim} not found; run bundle from a checkout or an existing bundle",
              file=sys.stderr)
        return 2
    dest = os.path.abspath(args.dir)
    os.makedirs(dest, exist_ok=True)
    shutil.copy2(shim, os.path.join(dest, "sitecustomize.py"))
    pkg_dest = os.path.join(dest, "hotfix")
    if os.path.abspath(os.path.join(home, "hotfix")) != pkg_dest:
        shutil.rmtree(pkg_dest, ignore_errors=True)
        shutil.copytree(os.path.join(home, "hotfix"), pkg_dest,
                        ignore=shutil.ignore_patterns("__pycache__", "_vendor", "*.pyc"))
    write_dist_info(dest)
    vendor = os.path.join(pkg_dest, "_vendor")
    shutil.rmtree(vendor, ignore_errors=True)
    os.makedirs(vendor)
    with open(os.path.join(vendor, "__init__.py"), "w") as fh:
        fh.write('"""Private copies of our dependencies, used only if the image lacks them."""\n')
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-compile", "--target", vendor,
           "wrapt>=2.4,<3,!=2.2.0", "structlog>=22", *args.pip_arg]
    done = subprocess.run(pip)
    if done.returncode != 0:
        print("bundle: installing the private dependencies failed", file=sys.stderr)
        return done.returncode
    _precompile(dest)
    print(f"bundle ready: PYTHONPATH={dest}")
    return 0


def _precompile(dest: str) -> None:
    """Ship .pyc files: a read-only mount cannot cache them, and compiling the shim at every
    interpreter start costs ~5 ms. Hash-checked, so copies that lose mtimes stay valid."""
    import compileall
    import py_compile

    mode = py_compile.PycInvalidationMode.CHECKED_HASH
    compileall.compile_file(os.path.join(dest, "sitecustomize.py"), quiet=1, invalidation_mode=mode)
    compileall.compile_dir(os.path.join(dest, "hotfix"), quiet=1, invalidation_mode=mode)


def cmd_repro(args) -> int:
    from hotfix import repro

    return repro.main(args.world, args.json, args.lmcache, args.verbose)


def cmd_shapes(args) -> int:
    from hotfix import shapes

    try:
        tree = shapes.Tree(args.dir)
        references = [shapes.Tree(path) for path in args.against]
        references += [shapes.Tree(shapes.download(version)) for version in args.download]
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"hotfix shapes: {exc}", file=sys.stderr)
        return 2
    rows = shapes.compare(tree, references)
    if args.json:
        print(json.dumps(shapes.as_json(tree, rows), indent=2))
    else:
        shapes.print_rows(tree, rows, references, args.all)
    return 1 if any(r.needs_work for r in rows) else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hotfix", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_status = sub.add_parser("status", help="what would be patched here (no vLLM import)")
    p_status.add_argument("--json", action="store_true")
    p_status.add_argument("--runtime", action="store_true",
                          help="what the running vLLM processes did (their status records), "
                               "with the per-engine totals /metrics shows")
    p_status.set_defaults(func=cmd_status)
    p_bundle = sub.add_parser("bundle", help="build the directory to put on PYTHONPATH")
    p_bundle.add_argument("dir")
    p_bundle.add_argument("--pip-arg", action="append", default=[],
                          help="extra argument for the pip that installs the private deps")
    p_bundle.set_defaults(func=cmd_bundle)
    p_repro = sub.add_parser("repro", help="the bug report's races on this vLLM, stock vs hotfix")
    p_repro.add_argument("--world", choices=("scheduler", "engine", "pd"), default="scheduler")
    p_repro.add_argument("--json", action="store_true")
    p_repro.add_argument("--verbose", action="store_true",
                         help="print vLLM's and the engines' logs too (they always go to files)")
    p_repro.add_argument("--lmcache", nargs="?", const="", default=None, metavar="DIR",
                         help="pd world: the real LMCache as the decode's second connector "
                              "(lmcache from DIR, a pip --target directory, or this interpreter's)")
    p_repro.set_defaults(func=cmd_repro)
    p_shapes = sub.add_parser("shapes", help="a vLLM tree's or wheel's patch targets against the "
                              "known shapes, with diffs (for a new release)")
    p_shapes.add_argument("dir", help="an unpacked vLLM tree (holding vllm/) or a vLLM wheel")
    p_shapes.add_argument("--against", action="append", default=[], metavar="DIR",
                          help="a reference release (tree or wheel) to diff against; repeatable")
    p_shapes.add_argument("--download", action="append", default=[], metavar="VERSION",
                          help="a reference release's wheel, fetched with pip (cached); repeatable")
    p_shapes.add_argument("--all", action="store_true", help="list the known targets too")
    p_shapes.add_argument("--json", action="store_true")
    p_shapes.set_defaults(func=cmd_shapes)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except config.ConfigError as exc:
        print(f"hotfix: {exc}", file=sys.stderr)
        return 2
