"""Production networks refuse to guess the tokenizer or the model; revisions pin them; the
tokenizer's content is part of the swarm's identity.

Real transformers and huggingface_hub throughout: "offline" is HF_HUB_OFFLINE with an
empty cache, and the Hub's answers (no such repo, no such revision, files at a revision)
come from a loopback server that speaks the Hub's resolve protocol, with HF_ENDPOINT
pointed at it in a child interpreter (huggingface_hub reads HF_ENDPOINT at import).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest

from dtrain.config import Config, load_config
from dtrain.training.errors import ModelLoadError, TokenizerLoadError

REPO = Path(__file__).resolve().parent.parent
PRODUCTION = ["finney", "test", "local", "ws://127.0.0.1:9944"]
MISSING = "nobody-dtrain-test/no-such-tokenizer"
SAMPLE = "the old mill by the river"


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE with an empty cache: nothing can be downloaded or found."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))
    return tmp_path


def _cfg(network: str, **data) -> Config:
    cfg = Config()
    cfg.chain.network = network
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def _other_tokenizer(tmp_path: Path) -> Path:
    """The shipped BPE with two token ids swapped: same size, same merges, other ids. A model
    fingerprint cannot tell it apart; the tokenizer digest must."""
    from dtrain.training.assets import FALLBACK_TOKENIZER
    from dtrain.training.tokenizer import load_fallback_tokenizer

    shipped = load_fallback_tokenizer()
    a, b = list(dict.fromkeys(shipped.convert_ids_to_tokens(shipped(SAMPLE)["input_ids"])))[:2]
    doc = json.loads(FALLBACK_TOKENIZER.read_text())
    vocab = doc["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path = tmp_path / "other.json"
    path.write_text(json.dumps(doc))
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    out = tmp_path / "other-tok"
    tok.save_pretrained(out)
    return out


# ------------------------------------------------------------------------ the policy


def test_fallback_is_off_by_default():
    assert Config().data.allow_tokenizer_fallback is False


@pytest.mark.parametrize("network", PRODUCTION)
def test_production_network_refuses_a_missing_tokenizer_and_says_how_to_get_it(network, offline):
    from dtrain.neurons.runtime import load_tokenizer_for

    with pytest.raises(TokenizerLoadError) as err:
        load_tokenizer_for(_cfg(network, tokenizer=MISSING))
    msg = str(err.value)
    assert f"data.tokenizer = '{MISSING}'" in msg  # what is missing, by its config key
    assert "not in the local Hugging Face cache" in msg and "HF_HUB_OFFLINE is set" in msg  # why
    assert f"hf download {MISSING}" in msg and str(offline / "empty-hf-cache") in msg  # how to get it, and where


def test_explicit_opt_in_falls_back_with_a_loud_warning(offline, caplog):
    from dtrain.neurons.runtime import load_tokenizer_for

    with caplog.at_level(logging.WARNING):
        tok, info = load_tokenizer_for(_cfg("finney", tokenizer=MISSING, allow_tokenizer_fallback=True))
    assert info.is_fallback and info.requested == MISSING and "shipped" in info.name
    assert info.vocab_size == len(tok) and info.digest
    loud = [r.getMessage() for r in caplog.records if "TOKENIZER FALLBACK" in r.getMessage()]
    assert len(loud) == 1 and "finney" in loud[0] and "WRONG_MODEL" in loud[0]


def test_sandbox_may_fall_back_and_the_shipped_tokenizer_is_no_fallback(offline, caplog):
    from dtrain.neurons.runtime import load_tokenizer_for

    with caplog.at_level(logging.WARNING):
        _, info = load_tokenizer_for(_cfg("sandbox", tokenizer=MISSING))
    assert info.is_fallback
    assert not any("TOKENIZER FALLBACK" in r.getMessage() for r in caplog.records)  # the sandbox is not the swarm
    _, shipped = load_tokenizer_for(_cfg("finney", tokenizer="shipped"))
    assert not shipped.is_fallback and shipped.digest == info.digest


def test_sandbox_config_from_init_trains_offline_with_the_shipped_tokenizer(clean_env, offline):
    from dtrain.neurons.runtime import build_workbench

    path = clean_env / "sandbox.toml"
    out = subprocess.run([sys.executable, "-m", "dtrain", "init", "--config", str(path), "--network", "sandbox",
                          "--role", "miner", "--no-prompt"], capture_output=True, text=True, timeout=120,
                         env={**os.environ})
    assert out.returncode == 0, out.stderr
    cfg, _ = load_config(path, env={})
    assert cfg.data.tokenizer == "shipped" and cfg.data.allow_tokenizer_fallback is False
    cfg.training.device = "cpu"
    bench = build_workbench(cfg)
    assert not bench.tokenizer_info.is_fallback and bench.reader.read_page(0) is not None


def test_missing_local_model_directory_is_named(offline):
    from dtrain.neurons.runtime import build_model, load_tokenizer_for

    cfg = _cfg("finney", tokenizer="shipped")
    cfg.model.hub_id = str(offline / "no-model-here")
    _, info = load_tokenizer_for(cfg)
    with pytest.raises(ModelLoadError, match=r"model.hub_id = '.*no-model-here'.*does not exist"):
        build_model(cfg, info)


def test_offline_hub_model_says_how_to_download_it(offline):
    from dtrain.neurons.runtime import build_model, load_tokenizer_for

    cfg = _cfg("finney", tokenizer="shipped")
    cfg.model.hub_id = "nobody-dtrain-test/no-such-model"
    _, info = load_tokenizer_for(cfg)
    with pytest.raises(ModelLoadError) as err:
        build_model(cfg, info)
    msg = str(err.value)
    assert "model.hub_id = 'nobody-dtrain-test/no-such-model'" in msg and "HF_HUB_OFFLINE is set" in msg
    assert "hf download nobody-dtrain-test/no-such-model" in msg


def test_a_model_smaller_than_the_vocabulary_is_refused(tmp_path, offline):
    from dtrain.neurons.runtime import NeuronError, build_model, load_tokenizer_for
    from dtrain.training.models import create_model

    create_model("tiny", vocab_size=100).save_pretrained(tmp_path / "m")
    cfg = _cfg("finney", tokenizer="shipped")
    cfg.model.hub_id = str(tmp_path / "m")
    _, info = load_tokenizer_for(cfg)
    with pytest.raises(NeuronError, match="100 token embeddings but tokenizer .* has 2355 tokens"):
        build_model(cfg, info)


def test_a_saved_tokenizer_directory_loads_with_no_revision(tmp_path, offline, caplog):
    from dtrain.neurons.runtime import load_tokenizer_for
    from dtrain.training.tokenizer import load_fallback_tokenizer

    load_fallback_tokenizer().save_pretrained(tmp_path / "tok")
    _, info = load_tokenizer_for(_cfg("finney", tokenizer=str(tmp_path / "tok")))
    assert not info.is_fallback and info.revision is None
    # a revision cannot apply to a directory: it is ignored, and the log says so
    with caplog.at_level(logging.WARNING):
        _, pinned = load_tokenizer_for(_cfg("finney", tokenizer=str(tmp_path / "tok"), tokenizer_revision="v1"))
    assert pinned.revision is None and pinned.digest == info.digest
    assert any("does not apply" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------ identity


def test_digest_survives_save_and_reload_and_tells_tokenizers_apart(tmp_path):
    from transformers import AutoTokenizer

    from dtrain.training.tokenizer import load_fallback_tokenizer, load_tokenizer, tokenizer_digest

    shipped = load_fallback_tokenizer()
    digest = tokenizer_digest(shipped)
    assert len(digest) == 64 and digest == tokenizer_digest(load_fallback_tokenizer())
    shipped.save_pretrained(tmp_path / "a")
    again = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert tokenizer_digest(again) == digest
    again.save_pretrained(tmp_path / "b")  # a second round trip
    _, info = load_tokenizer(str(tmp_path / "b"), local_files_only=True)
    assert info.digest == digest

    other_dir = _other_tokenizer(tmp_path)
    _, other = load_tokenizer(str(other_dir), local_files_only=True)
    assert other.vocab_size == info.vocab_size  # same size: the model fingerprint is the same
    assert shipped(SAMPLE)["input_ids"] != AutoTokenizer.from_pretrained(str(other_dir))(SAMPLE)["input_ids"]
    assert other.digest != digest


def test_digest_is_the_content_not_the_file_layout_or_class(tmp_path):
    """distilgpt2 on the Hub is vocab.json + merges.txt read by GPT2Tokenizer; save_pretrained
    writes tokenizer.json. The same vocabulary and merges in either layout tokenise alike and
    must hash alike, through any number of round trips."""
    from transformers import AutoTokenizer

    from dtrain.training.assets import CORPUS_DIR, FALLBACK_TOKENIZER
    from dtrain.training.tokenizer import load_fallback_tokenizer, tokenizer_digest

    bpe = json.loads(FALLBACK_TOKENIZER.read_text())["model"]
    hub_layout = tmp_path / "hub-layout"
    hub_layout.mkdir()
    (hub_layout / "vocab.json").write_text(json.dumps(bpe["vocab"]))
    merges = [" ".join(m) if isinstance(m, list) else m for m in bpe["merges"]]
    (hub_layout / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    eos = "<|endoftext|>"
    (hub_layout / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "eos_token": eos, "bos_token": eos, "unk_token": eos}))
    gpt2 = AutoTokenizer.from_pretrained(str(hub_layout))
    assert type(gpt2).__name__ == "GPT2Tokenizer"
    shipped = load_fallback_tokenizer()
    text = sorted(CORPUS_DIR.glob("*.txt"))[0].read_text()[:20000] + " héllo 日本"
    assert gpt2(text, add_special_tokens=False)["input_ids"] == shipped(text, add_special_tokens=False)["input_ids"]
    assert tokenizer_digest(gpt2) == tokenizer_digest(shipped)
    gpt2.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved" / "vocab.json").exists()  # another layout now
    assert tokenizer_digest(AutoTokenizer.from_pretrained(str(tmp_path / "saved"))) == tokenizer_digest(shipped)


def test_merges_spelled_as_strings_or_pairs_hash_alike(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from dtrain.training.assets import FALLBACK_TOKENIZER
    from dtrain.training.tokenizer import tokenizer_digest

    doc = json.loads(FALLBACK_TOKENIZER.read_text())
    merges = doc["model"]["merges"]
    as_strings = [" ".join(m) if isinstance(m, list) else m for m in merges]
    assert not any(" " in part for m in merges if isinstance(m, list) for part in m)
    doc["model"]["merges"] = as_strings
    path = tmp_path / "strings.json"
    path.write_text(json.dumps(doc))
    a = PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>")
    b = PreTrainedTokenizerFast(tokenizer_file=str(FALLBACK_TOKENIZER), eos_token="<|endoftext|>")
    assert tokenizer_digest(a) == tokenizer_digest(b)


def test_swarm_fingerprint_covers_tokenizer_content_and_revisions(tmp_path, offline):
    from dtrain.neurons.runtime import build_workbench, swarm_fingerprint

    base = Config()
    fp = swarm_fingerprint(base, "m", tokenizer_digest="a" * 64)
    assert fp == swarm_fingerprint(Config(), "m", tokenizer_digest="a" * 64)
    assert fp != swarm_fingerprint(base, "m", tokenizer_digest="b" * 64)
    pinned = Config()
    pinned.data.tokenizer_revision = "0123abc"
    assert swarm_fingerprint(pinned, "m", tokenizer_digest="a" * 64) != fp
    # model.revision counts only where a Hub model is read
    stale = Config()
    stale.model.revision = "v2"
    assert swarm_fingerprint(stale, "m", tokenizer_digest="a" * 64) == fp
    hub, hub_pinned = Config(), Config()
    hub.model.hub_id = hub_pinned.model.hub_id = "someone/model"
    hub_pinned.model.revision = "v2"
    assert swarm_fingerprint(hub, "m") != swarm_fingerprint(hub_pinned, "m")

    # end to end: two peers whose tokenizers differ only in content get different identities
    def bench(tokenizer):
        cfg = _cfg("sandbox", tokenizer=tokenizer, source="local")
        cfg.model.preset, cfg.model.seq_len, cfg.training.device = "tiny", 32, "cpu"
        return build_workbench(cfg)

    from dtrain.training.tokenizer import load_fallback_tokenizer

    import shutil

    # one setting (data.tokenizer names the same directory), other content in it
    where = tmp_path / "tok"
    load_fallback_tokenizer().save_pretrained(where)
    a, b = bench(str(where)), bench(str(where))
    other = _other_tokenizer(tmp_path)
    shutil.rmtree(where)
    shutil.copytree(other, where)
    c = bench(str(where))
    assert a.fingerprint == c.fingerprint  # the model cannot tell them apart
    assert a.swarm_fingerprint == b.swarm_fingerprint != c.swarm_fingerprint
    assert a.tokenizer_info.digest != c.tokenizer_info.digest


# ------------------------------------------------------------------------ a loopback Hub


class ReadOnlyHub:
    """The Hub's read side for a few repos: resolve (GET/HEAD) per revision, with the error
    codes the real Hub sends (RepoNotFound, RevisionNotFound, EntryNotFound)."""

    def __init__(self, repos: dict[str, dict[str, dict[str, bytes]]]) -> None:
        self.repos = repos  # repo -> revision -> {path: bytes}
        self.revisions: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, body=b"", headers=None):
                self.send_response(code)
                for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_HEAD(self):
                self.do_GET()

            def do_GET(self):
                parts = self.path.split("?", 1)[0].strip("/").split("/")
                if len(parts) < 5 or parts[2] != "resolve":
                    return self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"})
                repo, rev, file = f"{parts[0]}/{parts[1]}", unquote(parts[3]), unquote("/".join(parts[4:]))
                hub.revisions.append(rev)
                if repo not in hub.repos:
                    return self._send(404, b"{}", {"X-Error-Code": "RepoNotFound"})
                files = hub.repos[repo].get(rev)
                if files is None:
                    return self._send(404, b"{}", {"X-Error-Code": "RevisionNotFound"})
                if file not in files:
                    return self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"})
                data = files[file]
                sha = hashlib.sha1(repr(sorted(files)).encode() + rev.encode()).hexdigest()
                self._send(200, data, {"X-Repo-Commit": sha, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


_CHILD = r"""
import json, sys
from dtrain.config import Config
from dtrain.neurons.runtime import load_tokenizer_for
out = {}
for label, tokenizer, revision in json.loads(sys.argv[1]):
    cfg = Config()
    cfg.data.tokenizer, cfg.data.tokenizer_revision = tokenizer, revision
    try:
        _, info = load_tokenizer_for(cfg)
        out[label] = {"digest": info.digest, "revision": info.revision, "fallback": info.is_fallback}
    except Exception as exc:
        out[label] = {"error": type(exc).__name__, "message": str(exc)}
print(json.dumps(out))
"""


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}


def test_hub_revision_pinning_and_errors_through_a_loopback_hub(tmp_path):
    from dtrain.training.tokenizer import load_fallback_tokenizer, tokenizer_digest

    shipped = load_fallback_tokenizer()
    shipped.save_pretrained(tmp_path / "v1")
    other = _other_tokenizer(tmp_path)
    hub = ReadOnlyHub({"org/tok": {"v1": _files(tmp_path / "v1"), "main": _files(other)}})
    try:
        cases = [("pinned", "org/tok", "v1"), ("default", "org/tok", ""), ("no-repo", "org/nope", ""),
                 ("no-revision", "org/tok", "v9")]
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONPATH": str(REPO)}
        env.pop("HF_HUB_CACHE", None)
        out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cases)], env=env, capture_output=True,
                             text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        hub.close()
    # data.tokenizer_revision reaches the Hub: v1 is the shipped tokenizer, main the other one
    assert got["pinned"] == {"digest": tokenizer_digest(shipped), "revision": "v1", "fallback": False}
    assert got["default"]["digest"] != got["pinned"]["digest"] and got["default"]["revision"] is None
    assert "v1" in hub.revisions and "main" in hub.revisions
    # finney (the default network) names the problem instead of falling back
    assert got["no-repo"]["error"] == "TokenizerLoadError"
    assert "has no model repository 'org/nope'" in got["no-repo"]["message"]
    assert "data.tokenizer" in got["no-repo"]["message"] and "HF_TOKEN" in got["no-repo"]["message"]
    assert got["no-revision"]["error"] == "TokenizerLoadError"
    assert "has no revision 'v9'" in got["no-revision"]["message"]
    assert "data.tokenizer_revision" in got["no-revision"]["message"]


def test_unreachable_hub_is_told_apart_from_offline_and_missing():
    """The classification on the exception chains huggingface_hub builds. A real unreachable
    Hub costs the client ~45 s of retries, so its chain is rebuilt here from the same classes
    (LocalEntryNotFoundError raised from a refused connection), as transformers wraps it."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    from dtrain.training import hub_access

    def wrapped(inner: BaseException) -> OSError:
        try:
            try:
                raise inner
            except BaseException as exc:
                raise LocalEntryNotFoundError("cannot find the requested files in the local cache") from exc
        except LocalEntryNotFoundError as exc:
            outer = OSError("We couldn't connect to the Hub to load the files")
            outer.__cause__ = exc
            return outer

    refused = wrapped(ConnectionRefusedError(111, "Connection refused"))
    assert hub_access.classify(refused, offline=False) == hub_access.UNREACHABLE
    msg = hub_access.explain("tokenizer", "distilgpt2", refused, offline=False, key="data.tokenizer")
    assert "could not be reached (ConnectionRefusedError" in msg and "HF_ENDPOINT" in msg
    assert "cached copy is used" in msg and "hf download distilgpt2" in msg
    not_cached = OSError("We couldn't connect")
    not_cached.__cause__ = LocalEntryNotFoundError("outgoing traffic has been disabled")
    assert hub_access.classify(not_cached, offline=True) == hub_access.OFFLINE_MISSING
    # the same words for a dataset (dtrain.training.data may use them for data.dataset)
    msg = hub_access.explain("dataset", "HuggingFaceFW/fineweb", refused, offline=False, key="data.dataset",
                             revision="abc123", revision_key="data.dataset_revision", repo_type="dataset")
    assert "data.dataset = 'HuggingFaceFW/fineweb' at revision 'abc123'" in msg
    assert "hf download HuggingFaceFW/fineweb --repo-type dataset --revision abc123" in msg


def test_cli_prints_the_missing_tokenizer_without_a_traceback(tmp_path):
    """Through the CLI's error path (dtrain push rebuilds the model from the config when the
    checkpoint has no saved tokenizer): exit code non-zero, one clean message."""
    from dtrain.config import save_config
    from dtrain.neurons.runtime import build_workbench
    from dtrain.training.checkpoint import save_checkpoint
    from dtrain.training.loop import LoopState, training_state
    from tests.conftest import run_dtrain

    cfg = _cfg("sandbox", tokenizer="shipped", source="local")
    cfg.model.preset, cfg.model.seq_len, cfg.model.run_id, cfg.training.device = "tiny", 32, "run1", "cpu"
    bench = build_workbench(cfg)
    save_checkpoint(tmp_path / "ckpt", training_state(bench.trainer, LoopState(run_id="run1", uid=3, epoch=4)))
    cfg.chain.network, cfg.data.tokenizer, cfg.hub.repo = "finney", MISSING, str(tmp_path / "store")
    save_config(cfg, tmp_path / "c.toml")
    result = run_dtrain("push", "--config", str(tmp_path / "c.toml"), "--checkpoint", str(tmp_path / "ckpt"),
                        env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty-cache")})
    assert result.returncode != 0
    assert f"data.tokenizer = '{MISSING}'" in result.stderr and f"hf download {MISSING}" in result.stderr
    assert "Traceback" not in result.stderr


_OUTAGE = """
import json, threading
from dtrain.config import Config
from dtrain.neurons import runtime
from dtrain.neurons.base import NeuronBase
from dtrain.telemetry import Telemetry
from dtrain.training.errors import TokenizerLoadError

cfg = Config()
cfg.chain.network, cfg.data.tokenizer = "finney", "nobody-dtrain-test/a-tokenizer"
neuron = NeuronBase(cfg, Telemetry("miner"), threading.Event())
threading.Timer(1.0, neuron.stop.set).start()  # Ctrl-C while the Hub is down
result = neuron._with_input_retries(lambda: runtime.load_tokenizer_for(cfg), "loading the tokenizer and model",
                                    base_delay=0.01)
print(json.dumps({"result": list(result), "events": neuron.tel.snapshot().events}))
"""


@pytest.mark.slow
def test_a_hub_outage_while_loading_the_tokenizer_waits_instead_of_ending_the_node(tmp_path):
    """A restarted miner is still committed on chain: an unreachable Hub (here a closed
    loopback port, through huggingface_hub's own ~50 s of retries) is waited out, with the
    reason in its events, and Ctrl-C still ends the wait cleanly. Offline mode is not an
    outage: it fails at once (the other tests)."""
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    out = subprocess.run([sys.executable, "-c", _OUTAGE], env=env, capture_output=True, text=True, timeout=300,
                         cwd=str(REPO))
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["result"] == [False, None]
    retried = [e for e in doc["events"] if "loading the tokenizer and model:" in e]
    assert retried and "could not be reached" in retried[0] and "retrying in" in retried[0], doc["events"]
