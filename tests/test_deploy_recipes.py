"""``deploy/``: the Kubernetes component renders into an unmodified vLLM pod and its readiness
gate passes against the bundle laid out as the init container lays it out; ``docker run`` and
``ray start`` carry the same environment (``deploy/hotfix.env``), and the docker recipe's gate
passes on the mounted bundle and keeps the server from starting without it.

The pod is rendered with ``kubectl kustomize`` where kubectl is installed, and always with the small
renderer below (the component's subset of kustomize: strategic-merge patches of named lists,
JSON 6902 ``add`` ops, an image override); where both run, their pods must be equal, so the
fallback cannot drift from kustomize."""
from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, build_bundle, clean_env

DEPLOY = Path(REPO) / "deploy" / "kubernetes"
HOTFIX_ENV = Path(REPO) / "deploy" / "hotfix.env"
BUNDLE_MOUNT = "/opt/vllm-hotfix"


# ------------------------------------------------------------------ the fallback renderer
def _merge(base, patch):
    """Strategic merge as the component uses it: maps recursively, lists of named maps by name."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = _merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and all(isinstance(i, dict) and "name" in i
                                                                  for i in base + patch):
        names = [i["name"] for i in patch]
        by_name = {i["name"]: i for i in base}
        merged = [_merge(by_name[i["name"]], i) if i["name"] in by_name else copy.deepcopy(i) for i in patch]
        return merged + [i for i in base if i["name"] not in names]
    return copy.deepcopy(patch)


def _json_add(doc, path: str, value) -> None:
    *parents, last = [p for p in path.split("/")[1:]]
    for part in parents:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    if isinstance(doc, list):
        doc.append(value) if last == "-" else doc.insert(int(last), value)
    else:
        doc[last] = value


def _selected(obj: dict, target: dict) -> bool:
    key, _, value = target["labelSelector"].partition("=")
    return obj["kind"] == target["kind"] and obj["metadata"].get("labels", {}).get(key) == value


def render_here(overlay: Path) -> list[dict]:
    spec = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    objects = [yaml.safe_load((overlay / r).read_text()) for r in spec["resources"]]
    for component in spec.get("components", ()):
        folder = overlay / component
        for patch in yaml.safe_load((folder / "kustomization.yaml").read_text())["patches"]:
            body = yaml.safe_load((folder / patch["path"]).read_text())
            for i, obj in enumerate(objects):
                if not _selected(obj, patch["target"]):
                    continue
                if isinstance(body, list):  # JSON 6902
                    for op in body:
                        assert op["op"] == "add", op
                        _json_add(obj, op["path"], copy.deepcopy(op["value"]))
                else:
                    objects[i] = _merge(obj, {"spec": body["spec"]})
    for image in spec.get("images", ()):
        for obj in objects:
            pod = obj["spec"]["template"]["spec"]
            for container in pod.get("initContainers", []) + pod["containers"]:
                if container["image"] == image["name"]:
                    container["image"] = f"{image['newName']}:{image['newTag']}"
    return objects


def render_with_kubectl(overlay: Path) -> list[dict] | None:
    if shutil.which("kubectl") is None:
        return None
    done = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return list(yaml.safe_load_all(done.stdout))


def _normalized(objects: list[dict]) -> list[dict]:
    """Order-free where Kubernetes is: lists of named maps sorted by name."""
    def norm(node):
        if isinstance(node, dict):
            return {k: norm(v) for k, v in node.items()}
        if isinstance(node, list):
            items = [norm(i) for i in node]
            if all(isinstance(i, dict) and "name" in i for i in items) and items:
                return sorted(items, key=lambda i: i["name"])
            return items
        return node
    return [norm(o) for o in objects]


@pytest.fixture(scope="module")
def pod():
    overlay = DEPLOY / "example"
    here = render_here(overlay)
    rendered = render_with_kubectl(overlay)
    if rendered is not None:
        assert _normalized(rendered) == _normalized(here)
    (deployment,) = here
    return deployment["spec"]["template"]["spec"]


def test_the_component_delivers_the_bundle_and_leaves_vllms_container_as_it_was(pod):
    original = yaml.safe_load((DEPLOY / "example" / "vllm-decode.yaml").read_text())
    before = original["spec"]["template"]["spec"]["containers"][0]
    (vllm,) = pod["containers"]
    (init,) = pod["initContainers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in vllm["volumeMounts"]}
    env = [(e["name"], e["value"]) for e in vllm["env"]]

    assert init["image"] == "registry.example.com/vllm-hotfix-bundle:0.1.0"
    assert init["command"] == ["cp", "-a", "/bundle/.", f"{BUNDLE_MOUNT}/"]
    assert init["volumeMounts"] == [{"name": "vllm-hotfix", "mountPath": BUNDLE_MOUNT}]
    assert volumes["vllm-hotfix"]["emptyDir"] == volumes["vllm-hotfix-status"]["emptyDir"] == {}
    assert mounts["vllm-hotfix"] == {"name": "vllm-hotfix", "mountPath": BUNDLE_MOUNT, "readOnly": True}
    assert ("PYTHONPATH", f"{BUNDLE_MOUNT}:$(PYTHONPATH)") in env
    assert ("HOTFIX_STATUS_DIR", mounts["vllm-hotfix-status"]["mountPath"]) in env
    assert vllm["startupProbe"]["exec"]["command"] == ["python3", "-m", "hotfix", "status"]
    # vLLM's own: command, args, probes, env and mounts unchanged and first
    for key in ("image", "command", "args", "ports", "readinessProbe"):
        assert vllm[key] == before[key], key
    assert vllm["env"][:len(before["env"])] == before["env"]
    assert vllm["volumeMounts"][:len(before["volumeMounts"])] == before["volumeMounts"]
    assert volumes["shm"] == original["spec"]["template"]["spec"]["volumes"][0]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """The files the bundle image holds under /bundle."""
    return build_bundle(tmp_path_factory.mktemp("bundle-image") / "vllm-hotfix")


def run_probe(pod, bundle_dir: Path, tmp_path: Path):
    """The startup probe's command with the container's env, in a pod whose bundle emptyDir is
    ``bundle_dir``: ``$(PYTHONPATH)`` is left as Kubernetes leaves an undefined variable."""
    (vllm,) = pod["containers"]
    env = clean_env()
    for item in vllm["env"]:
        env[item["name"]] = item["value"].replace(BUNDLE_MOUNT, str(bundle_dir))
    env["HOTFIX_STATUS_DIR"] = str(tmp_path / "status")
    command = [sys.executable if part == "python3" else part for part in vllm["startupProbe"]["exec"]["command"]]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_the_readiness_gate_passes_on_the_copied_bundle_and_fails_without_it(pod, bundle, tmp_path):
    copied = tmp_path / "emptydir"
    copied.mkdir()
    subprocess.run(["cp", "-a", f"{bundle}/.", f"{copied}/"], check=True)  # the init container
    passed = run_probe(pod, copied, tmp_path)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert f"sitecustomize: ours={copied}/sitecustomize.py" in passed.stdout and "[APPLY]" in passed.stdout

    empty = tmp_path / "init-never-ran"
    empty.mkdir()
    failed = run_probe(pod, empty, tmp_path)  # the red: no bundle, no gate
    assert failed.returncode != 0 and "No module named hotfix" in failed.stderr


# ------------------------------------------------------------------ docker run and ray start
def read_env_file(path: Path) -> dict:
    """As ``docker run --env-file`` reads it: KEY=VALUE lines taken literally, ``#`` comments."""
    lines = [line.strip() for line in path.read_text().splitlines()]
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


# A stand-in for the docker CLI (no registry, no daemon on CI): ``run`` with -v/--env-file/
# --entrypoint runs the container's command here, with the env file's environment and each
# mount's container path rewritten to its host path; every call is logged, one JSON per line.
FAKE_DOCKER = r"""
import json, os, subprocess, sys
args = sys.argv[1:]
with open(os.environ["FAKE_DOCKER_LOG"], "a") as log:
    log.write(json.dumps(args) + "\n")
assert args[0] == "run", args
mounts, env, entrypoint, i = {}, {"PATH": os.environ["PATH"]}, None, 1
while args[i].startswith("-"):
    flag = args[i]
    if flag in ("--rm", "--ipc=host"):
        i += 1
        continue
    value, i = args[i + 1], i + 2
    if flag == "-v":
        host, container = value.split(":")[:2]
        mounts[container] = host
    elif flag == "--env-file":
        for line in open(value):
            line = line.strip()
            if line and not line.startswith("#"):
                key, _, val = line.partition("=")
                env[key] = val
    elif flag == "--entrypoint":
        entrypoint = value
command = args[i + 1:]
if entrypoint is None:  # the image's own entrypoint: the vLLM server
    sys.exit(0)
def host(value):
    for container, path in mounts.items():
        if os.path.isabs(path):
            value = value.replace(container, path)
        else:  # a named volume
            value = value.replace(container, os.path.join(os.environ["FAKE_DOCKER_VOLUMES"], path))
    return value
env = {k: host(v) for k, v in env.items()}
exe = sys.executable if entrypoint == "python3" else entrypoint
sys.exit(subprocess.run([exe] + command, env=env).returncode)
"""


def run_docker_recipe(bundle_dir: Path, tmp_path: Path):
    fake = tmp_path / "docker"
    fake.write_text(f"#!{sys.executable}\n{FAKE_DOCKER}")
    fake.chmod(0o755)
    log = tmp_path / "docker-calls.jsonl"
    env = clean_env(BUNDLE=str(bundle_dir), DOCKER=str(fake), FAKE_DOCKER_LOG=str(log),
                    FAKE_DOCKER_VOLUMES=str(tmp_path / "volumes"))
    done = subprocess.run(["sh", str(Path(REPO) / "deploy" / "docker" / "run.sh"), "--model", "m"],
                          env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return done, calls


def test_docker_run_gates_on_the_mounted_bundle_then_starts_vllm_with_the_same_mounts(bundle, tmp_path):
    done, calls = run_docker_recipe(bundle, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"sitecustomize: ours={bundle}/sitecustomize.py" in done.stdout and "[APPLY]" in done.stdout
    gate, server = calls
    assert gate[gate.index("--entrypoint") + 1:] == ["python3", "vllm/vllm-openai:v0.34.0", "-m", "hotfix", "status"]
    assert server[-3:] == ["vllm/vllm-openai:v0.34.0", "--model", "m"]
    def hotfix_options(call):
        pairs = zip(call, call[1:])
        return sorted((flag, str(Path(v).resolve()) if flag == "--env-file" else v)
                      for flag, v in pairs if flag in ("-v", "--env-file"))
    assert hotfix_options(gate) == hotfix_options(server) == sorted([
        ("-v", f"{bundle}:/opt/vllm-hotfix:ro"), ("-v", "vllm-hotfix-status:/var/run/vllm-hotfix"),
        ("--env-file", str(HOTFIX_ENV))])

    empty, red = tmp_path / "no-bundle", tmp_path / "red"
    empty.mkdir()
    red.mkdir()
    failed, calls = run_docker_recipe(empty, red)  # the red: an empty directory mounted
    assert failed.returncode != 0 and "No module named hotfix" in failed.stderr
    assert len(calls) == 1, "the server must not start when the gate fails"


def test_ray_start_and_runtime_env_give_every_worker_the_env_docker_gives_a_container(tmp_path):
    wanted = read_env_file(HOTFIX_ENV)
    assert wanted["PYTHONPATH"] == BUNDLE_MOUNT and wanted["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] == "HOTFIX_"
    fake_ray = tmp_path / "ray"
    fake_ray.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                        "print(json.dumps({'argv': sys.argv[1:], 'env': dict(os.environ)}))\n")
    fake_ray.chmod(0o755)
    done = subprocess.run(["sh", str(Path(REPO) / "deploy" / "ray" / "ray-start.sh"), "--head"],
                          env=clean_env(RAY=str(fake_ray)), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    raylet = json.loads(done.stdout)
    assert raylet["argv"] == ["start", "--head"]
    assert {k: raylet["env"].get(k) for k in wanted} == wanted  # exported, so the raylet's workers inherit it
    runtime_env = json.loads((Path(REPO) / "deploy" / "ray" / "runtime-env.json").read_text())
    assert runtime_env == {"env_vars": wanted}
