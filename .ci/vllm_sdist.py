"""Fetch a release's sdist from the configured package index and extract a few members of it.

    python .ci/vllm_sdist.py PROJECT VERSION DEST MEMBER...

Run it with the venv's python: the index is what that pip is configured with (PIP_INDEX_URL,
`pip config`'s index-url, then its extra-index-urls; default https://pypi.org/simple), read
through the simple API (JSON, PEP 691, or HTML, PEP 503) exactly as pip finds the link. `pip
download --no-binary :all:` cannot be used for vLLM: it builds the sdist's metadata (CMake,
CUDA) and keeps no file when that fails. The file is checked against the index's sha256 and kept
in $HOTFIX_UNIT_CACHE (default ~/.cache/vllm-hotfix); MEMBERs (paths inside the sdist's top
directory, e.g. `tests` `pyproject.toml`) are extracted into DEST, nothing else. Stdlib only.
"""
import hashlib
import html.parser
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path

ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"


def index_urls() -> list[str]:
    """The index URLs the venv's pip uses, in pip's order (index-url first)."""
    primary, extra = [], []
    if os.environ.get("PIP_INDEX_URL"):
        primary.append(os.environ["PIP_INDEX_URL"])
    extra += os.environ.get("PIP_EXTRA_INDEX_URL", "").split()
    try:
        listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                                text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        listed = ""
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        value = value.strip().strip("'\"")
        if key.endswith(".index-url") and not key.endswith("extra-index-url"):
            primary.append(value)
        elif key.endswith(".extra-index-url"):
            extra += value.split()
    urls = (primary[:1] or ["https://pypi.org/simple"]) + extra
    return list(dict.fromkeys(u.rstrip("/") for u in urls if u))


def ssl_context() -> ssl.SSLContext:
    cafile = os.environ.get("PIP_CERT")
    return ssl.create_default_context(cafile=cafile if cafile and os.path.exists(cafile) else None)


def get(url: str, accept: str | None = None):
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    kwargs = {"context": ssl_context()} if url.startswith("https:") else {}
    return urllib.request.urlopen(req, timeout=180, **kwargs)


class _Anchors(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []  # (text, href)
        self._href = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data):
        if self._href is not None:
            self.links.append((data.strip(), self._href))
            self._href = None


def find_sdist(project: str, version: str) -> tuple[str, str | None]:
    """(url, sha256 or None) of PROJECT-VERSION.tar.gz on the first index that lists it."""
    norm = re.sub(r"[-_.]+", "-", project).lower()
    wanted = f"{re.sub(r'[-.]+', '_', project).lower()}-{version}.tar.gz"
    tried = []
    for index in index_urls():
        page = f"{index}/{norm}/"
        try:
            with get(page, ACCEPT) as resp:
                body, base = resp.read(), resp.geturl()
                ctype = resp.headers.get("Content-Type", "")
        except Exception as exc:  # noqa: BLE001 - try the next index
            tried.append(f"{page}: {exc}")
            continue
        files = []
        if "json" in ctype:
            for f in json.loads(body).get("files", []):
                files.append((f["filename"], f["url"], (f.get("hashes") or {}).get("sha256")))
        else:
            parser = _Anchors()
            parser.feed(body.decode("utf-8", "replace"))
            for text, href in parser.links:
                url, _, frag = href.partition("#")
                name = text or urllib.parse.unquote(url.rsplit("/", 1)[-1])
                files.append((name, url, frag[len("sha256="):] if frag.startswith("sha256=") else None))
        for name, url, sha in files:
            if name.lower() == wanted or name.lower() == f"{norm}-{version}.tar.gz":
                return urllib.parse.urljoin(base, url), sha
        tried.append(f"{page}: no {wanted}")
    raise SystemExit(f"sdist {project}=={version} not found:\n  " + "\n  ".join(tried))


def fetch(project: str, version: str) -> Path:
    cache = Path(os.environ.get("HOTFIX_UNIT_CACHE") or Path.home() / ".cache" / "vllm-hotfix")
    cache.mkdir(parents=True, exist_ok=True)
    url, sha = find_sdist(project, version)
    target = cache / url.rsplit("/", 1)[-1].split("#")[0]

    def digest(path: Path) -> str:
        h = hashlib.sha256()
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()

    if target.exists() and (sha is None or digest(target) == sha):
        print(f"   sdist {target} (cached; {url})")
        return target
    tmp = target.with_suffix(".part")
    with get(url) as resp, tmp.open("wb") as out:
        shutil.copyfileobj(resp, out, 1 << 20)
    if sha is not None and digest(tmp) != sha:
        tmp.unlink()
        raise SystemExit(f"{url}: sha256 differs from the index's {sha}")
    tmp.replace(target)
    print(f"   sdist {target} ({target.stat().st_size >> 20} MiB from {url})")
    return target


def extract(sdist: Path, dest: Path, members: list[str]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    found = {p: 0 for p in members}
    with tarfile.open(sdist, mode="r|gz") as tar:  # one streaming pass
        for m in tar:
            rest = m.name.partition("/")[2]
            for p in members:
                if rest == p or rest.startswith(p.rstrip("/") + "/"):
                    m.name = rest
                    tar.extract(m, dest, **kwargs)
                    found[p] += 1
                    break
    missing = [p for p, n in found.items() if not n]
    if missing:
        raise SystemExit(f"{sdist}: no {', '.join(missing)}")
    print(f"   extracted {', '.join(members)} ({sum(found.values())} entries) into {dest}")


def main(argv: list[str]) -> int:
    if len(argv) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    project, version, dest, *members = argv
    extract(fetch(project, version), Path(dest), members)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
