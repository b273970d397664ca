"""HfStore through the real huggingface_hub client against a loopback fake Hub.

The fake implements just the endpoints a push uses (repo create, refs, preupload, commit,
tag) and can inject failures per endpoint: HTTP 5xx, 401, or a dropped connection. It
answers every preupload with uploadMode "regular", so files travel base64 inside the
commit and no LFS/xet transfer is involved.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dtrain.hub.base import StoreAuthError, StoreError, StoreNotFoundError
from dtrain.hub.hf import HfStore, parse_hf_target
from dtrain.hub.retry import RetryPolicy
from dtrain.hub.targets import open_store

_ROUTES = [
    ("create", "POST", re.compile(r"^/api/repos/create$")),
    ("refs", "GET", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/refs$")),
    ("preupload", "POST", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<rev>[^/]+)$")),
    ("commit", "POST", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<rev>[^/]+)$")),
    ("tag", "POST", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tag/(?P<rev>[^/]+)$")),
    ("tree", "GET", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(/.*)?$")),
    ("info", "GET", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(/revision/(?P<rev>[^/]+))?$")),
    ("validate", "POST", re.compile(r"^/api/validate-yaml$")),
    ("resolve", "GET", re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")),
    ("resolve", "HEAD", re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")),
]

_LICENSES = {"apache-2.0", "mit", "openrail", "cc-by-4.0", "other"}  # a few of the Hub's licence ids


class FakeHub:
    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.repos: dict[str, dict] = {}  # repo -> {"files": {path: bytes}, "head": sha, "tags": {name: sha}}
        self.faults: dict[str, list[str]] = defaultdict(list)
        self.calls: Counter[str] = Counter()
        self.validated: list[str] = []  # README.md texts the client asked the Hub to validate
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # keep test output clean
                pass

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

            def do_HEAD(self):
                self._handle("HEAD")

            def _json(self, code, obj, headers=None):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def _handle(self, method):
                path = self.path.split("?", 1)[0]
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                for name, m, rx in _ROUTES:
                    match = rx.match(path)
                    if m == method and match:
                        break
                else:
                    return self._json(404, {"error": f"fake hub: no route {method} {path}"})
                with hub.lock:
                    hub.calls[name] += 1
                    fault = hub.faults[name].pop(0) if hub.faults[name] else None
                if fault == "drop":
                    # Close without a response: the client sees a protocol/connection error.
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if fault is not None:
                    return self._json(int(fault), {"error": f"injected {fault}"})
                if hub.token is not None and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self._json(401, {"error": "Invalid credentials in Authorization header"},
                                      {"X-Error-Message": "Invalid credentials in Authorization header"})
                return getattr(hub, "_" + name)(self, match, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    # -- endpoint handlers
    def _repo(self, h, repo):
        r = self.repos.get(repo)
        if r is None:
            h._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
        return r

    def _create(self, h, m, body):
        d = json.loads(body)
        repo = f"{d['organization']}/{d['name']}"
        with self.lock:
            if repo in self.repos:
                # The real Hub includes the url in its 409, and the client reads it.
                return h._json(409, {"error": "You already created this model repo", "url": f"{self.url}/{repo}"})
            self.repos[repo] = {"files": {}, "head": "0" * 40, "tags": {}}
        h._json(200, {"url": f"{self.url}/{repo}"})

    def _files_at(self, h, repo, rev):
        """(sha, files) of a revision (branch main, tag or commit), or None after a 404."""
        from urllib.parse import unquote

        r = self._repo(h, repo)
        if r is None:
            return None
        rev = unquote(rev or "main")
        sha = r["head"] if rev == "main" else r["tags"].get(rev, rev)
        files = r.get("snapshots", {}).get(sha)
        if files is None:
            h._json(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
            return None
        return sha, files

    def _info(self, h, m, body):
        got = self._files_at(h, m["repo"], m["rev"])
        if got is not None:
            sha, files = got
            h._json(200, {"id": m["repo"], "sha": sha, "siblings": [{"rfilename": p} for p in files]})

    def _tree(self, h, m, body):
        got = self._files_at(h, m["repo"], m["rev"])
        if got is not None:
            h._json(200, [{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                          for p, b in sorted(got[1].items())])

    def _resolve(self, h, m, body):
        from urllib.parse import unquote

        got = self._files_at(h, m["repo"], m["rev"])
        if got is None:
            return
        sha, files = got
        data = files.get(unquote(m["file"]))
        if data is None:
            return h._json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
        h.send_response(200)
        h.send_header("Content-Length", str(len(data)))
        h.send_header("X-Repo-Commit", sha)
        h.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)

    def _validate(self, h, m, body):
        """Like the Hub: README.md front matter must be a YAML mapping with a known licence."""
        import yaml

        content = json.loads(body)["content"]
        self.validated.append(content)
        errors = []
        if content.startswith("---\n"):
            meta = yaml.safe_load(content.split("\n---", 2)[0][4:])
            if not isinstance(meta, dict):
                errors.append({"message": "metadata must be a mapping"})
            elif "license" in meta and meta["license"] not in _LICENSES:
                errors.append({"message": f'"license" must be one of [{", ".join(sorted(_LICENSES))}]'})
        h._json(400 if errors else 200, {"errors": errors, "warnings": []})

    def _refs(self, h, m, body):
        r = self._repo(h, m["repo"])
        if r is None:
            return
        tags = [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": sha} for t, sha in r["tags"].items()]
        h._json(200, {"branches": [{"name": "main", "ref": "refs/heads/main", "targetCommit": r["head"]}],
                      "converts": [], "tags": tags})

    def _preupload(self, h, m, body):
        if self._repo(h, m["repo"]) is None:
            return
        files = json.loads(body)["files"]
        h._json(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]})

    def _commit(self, h, m, body):
        r = self._repo(h, m["repo"])
        if r is None:
            return
        for line in body.splitlines():
            item = json.loads(line)
            if item["key"] == "file":
                r["files"][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            elif item["key"] not in ("header", "deletedFile"):
                return h._json(400, {"error": f"fake hub does not accept {item['key']}"})
        sha = hashlib.sha1(json.dumps(sorted((k, v.hex()) for k, v in r["files"].items())).encode()).hexdigest()
        r["head"] = sha
        r.setdefault("snapshots", {})[sha] = dict(r["files"])
        h._json(200, {"commitUrl": f"{self.url}/{m['repo']}/commit/{sha}", "commitOid": sha})

    def _tag(self, h, m, body):
        r = self._repo(h, m["repo"])
        if r is None:
            return
        tag = json.loads(body)["tag"]
        if tag in r["tags"]:
            return h._json(409, {"error": "Tag already exists"})
        r["tags"][tag] = m["rev"]
        h._json(200, {})

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *a):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub():
    with FakeHub(token="good-token") as h:
        yield h


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ckpt"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text('{"n_layer": 2}')
    (d / "model.safetensors").write_bytes(os.urandom(4096))
    (d / "sub" / "optimizer.bin").write_bytes(b"\x00\x01" * 1000)
    return d


def _store(hub, sleeps, **kw):
    kw.setdefault("retry", RetryPolicy(attempts=4, base_delay=0.5, jitter=0.0))
    return HfStore("alice/dtrain-run", endpoint=hub.url, token="good-token", sleep=sleeps.append, **kw)


def test_parse_target():
    assert parse_hf_target("hf://alice/model") == "alice/model"
    for bad in ("hf://alice", "hf://a/b/c", "hf:///b", "s3://a/b"):
        with pytest.raises(StoreError):
            parse_hf_target(bad)
    with pytest.raises(ValueError, match="unsupported"):
        open_store("s3://a/b")


def test_push_creates_repo_uploads_and_tags(hub, ckpt):
    sleeps: list[float] = []
    events = []
    store = _store(hub, sleeps)
    res = store.push(ckpt, "run1.0.10", progress=events.append)
    repo = hub.repos["alice/dtrain-run"]
    assert repo["tags"]["run1.0.10"] == res.revision == repo["head"]
    files = repo["snapshots"][res.revision]
    assert files["config.json"] == b'{"n_layer": 2}'
    assert files["sub/optimizer.bin"] == b"\x00\x01" * 1000
    assert res.attempts == 4 and not res.already_existed and sleeps == []  # create, refs, upload, tag
    assert res.url.endswith("/alice/dtrain-run/tree/run1.0.10")
    stages = [e.stage for e in events]
    assert stages[0] == "prepare" and stages[-1] == "done" and "upload" in stages and "tag" in stages
    assert events[-1].bytes_done == events[-1].bytes_total == res.bytes_total > 0
    # second push: repo exists (409 on create is fine), new tag
    (ckpt / "config.json").write_text('{"n_layer": 3}')
    store.push(ckpt, "run1.1.0")
    assert store.list_tags() == ["run1.0.10", "run1.1.0"]
    assert store.latest() == "run1.1.0" and store.latest("other") is None
    # repeating a tag is a no-op that reports it
    again = store.push(ckpt, "run1.0.10")
    assert again.already_existed and again.revision == res.revision
    assert hub.calls["commit"] == 2


def test_injected_failures_then_success(hub, ckpt):
    hub.faults["create"] = ["503", "drop"]
    hub.faults["tag"] = ["500", "502"]
    hub.faults["refs"] = ["drop"]
    sleeps: list[float] = []
    events = []
    res = _store(hub, sleeps).push(ckpt, "run1.2.0", progress=events.append)
    assert hub.calls["create"] == 3 and hub.calls["tag"] == 3 and hub.calls["refs"] == 2
    assert res.attempts == 3 + 2 + 1 + 3  # create + refs + upload + tag
    assert "run1.2.0" in hub.repos["alice/dtrain-run"]["tags"]
    # exponential backoff per step: 0.5, 1.0 for create; 0.5 for refs; 0.5, 1.0 for tag
    assert sleeps == [0.5, 1.0, 0.5, 0.5, 1.0]
    assert sum(e.stage == "retry" for e in events) == 5


def test_commit_5xx_is_absorbed_by_client_backoff(hub, ckpt):
    # huggingface_hub retries preupload/commit itself (http_backoff, ~1 s); our step sees
    # one successful attempt.
    hub.faults["commit"] = ["503"]
    res = _store(hub, []).push(ckpt, "run1.3.0")
    assert hub.calls["commit"] == 2 and res.attempts == 4


def test_gives_up_after_max_attempts(hub, ckpt):
    hub.faults["tag"] = ["503"] * 10
    sleeps: list[float] = []
    with pytest.raises(StoreError, match=r"after 4 attempts") as ei:
        _store(hub, sleeps).push(ckpt, "run1.4.0")
    assert ei.value.retryable and ei.value.attempts == 4
    assert hub.calls["tag"] == 4 and len(sleeps) == 3


def test_bad_token_is_fatal_and_clear(hub, ckpt):
    sleeps: list[float] = []
    store = HfStore("alice/dtrain-run", endpoint=hub.url, token="wrong", sleep=sleeps.append)
    with pytest.raises(StoreAuthError) as ei:
        store.push(ckpt, "run1.0.0")
    msg = str(ei.value)
    assert "401" in msg and "HF_TOKEN" in msg and hub.url in msg
    assert sleeps == [] and hub.calls["create"] == 1 and ei.value.attempts == 1
    assert hub.calls["commit"] == 0


def test_forbidden_is_fatal(hub, ckpt):
    hub.faults["create"] = ["403"]
    hub.faults["info"] = ["403"]
    sleeps: list[float] = []
    with pytest.raises(StoreAuthError, match="403"):
        _store(hub, sleeps).push(ckpt, "run1.0.0")
    assert sleeps == []


def test_list_tags_of_missing_repo_is_empty(hub):
    store = _store(hub, [])
    assert store.list_tags() == [] and store.latest() is None


def test_hf_endpoint_and_hf_token_from_environment(hub, ckpt, tmp_path):
    """HF_ENDPOINT/HF_TOKEN set before import are honoured with no endpoint/token passed."""
    code = (
        "import sys\n"
        "from dtrain.hub.targets import open_store\n"
        "from huggingface_hub import constants\n"
        "assert constants.ENDPOINT == sys.argv[1], constants.ENDPOINT\n"
        "s = open_store('hf://bob/model')\n"
        "print(s.push(sys.argv[2], 'envrun.0.1').revision)\n"
    )
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_TOKEN="good-token", HF_HOME=str(tmp_path / "hfhome"),
               HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_OFFLINE="0")
    out = subprocess.run([sys.executable, "-c", code, hub.url, str(ckpt)], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert hub.repos["bob/model"]["tags"]["envrun.0.1"] == out.stdout.strip()


def test_fetch_tag_through_snapshot_download(hub, ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    store = _store(hub, [])
    store.push(ckpt, "run1.0.1")
    (ckpt / "config.json").write_text('{"n_layer": 9}')
    store.push(ckpt, "run1.0.2")
    out = store.fetch("run1.0.1", tmp_path / "dl")
    assert (out / "config.json").read_text() == '{"n_layer": 2}'
    assert (out / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()
    assert (out / "sub" / "optimizer.bin").exists()
    with pytest.raises(StoreNotFoundError):
        store.fetch("run1.9.9", tmp_path / "dl2")


def test_a_model_repo_folder_uploads_whole_and_loads_back(hub, tmp_path, monkeypatch):
    """What miners push (dtrain.neurons.publish) goes up as one folder, tokenizer and card
    included, and a download of the tag loads with the Auto classes on its own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dtrain.hub.model_card import CardFacts
    from dtrain.neurons.publish import write_model_repo
    from dtrain.training.models import create_model
    from dtrain.training.tokenizer import load_fallback_tokenizer

    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    tok = load_fallback_tokenizer()
    model = create_model("tiny", vocab_size=len(tok), n_positions=32, eos_token_id=tok.eos_token_id)
    folder = write_model_repo(tmp_path / "repo", model, tok, CardFacts(
        tag="run1.2.2", run_id="run1", epoch=2, inner_step=2, repo_id="alice/dtrain-run", contributors=2))
    store = _store(hub, [])
    res = store.push(folder, "run1.2.2")
    assert hub.validated == [(folder / "README.md").read_text()]  # the Hub's metadata check passed
    uploaded = set(hub.repos["alice/dtrain-run"]["snapshots"][res.revision])
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "README.md"} <= uploaded
    assert uploaded == {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    out = store.fetch("run1.2.2", tmp_path / "dl")
    loaded = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert len(loaded) == len(tok) and loaded.decode(loaded("a round trip")["input_ids"]) == "a round trip"
    assert AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).config.vocab_size == len(tok)
    assert "alice/dtrain-run" in (out / "README.md").read_text()


def test_a_card_the_hub_refuses_does_not_hold_up_the_weights(hub, ckpt, caplog):
    (ckpt / "README.md").write_text('---\nlicense: "not-a-licence"\n---\n# card\n')
    res = _store(hub, []).push(ckpt, "run1.5.0")
    files = hub.repos["alice/dtrain-run"]["snapshots"][res.revision]
    assert "README.md" not in files and "model.safetensors" in files
    assert hub.repos["alice/dtrain-run"]["tags"]["run1.5.0"] == res.revision
    assert any("rejected the model card" in r.getMessage() and "license" in r.getMessage() for r in caplog.records)
