"""End to end: `dtrain sandbox` runs a real subnet (processes, DHT, chain, API) and reports it."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import run_dtrain

# The module fixture runs a whole sandbox inside the first test's setup; pytest-timeout
# counts it, so the limit is the fixture's own hang guard, not the 600 s default.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _processes_mentioning(text: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if text in line and "ps -eo" not in line]


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    root = tmp_path_factory.mktemp("sandbox") / "box"
    result = run_dtrain("sandbox", "--miners", "2", "--rounds", "2", "--dir", str(root), "--json", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return root, json.loads(result.stdout), result


def test_summary_has_rounds_miners_and_a_falling_loss(sandbox):
    root, doc, _ = sandbox
    assert [r["round"] for r in doc["rounds"]] == [1, 2]
    for r in doc["rounds"]:
        assert r["status"] == "success"
        # A rare lost part (hivemind transport, docs/swarm.md) leaves a share local, the
        # validator records its reducer as FAIL for that round and the neurons resynchronise;
        # the round itself must still have averaged most of the vector. A miner the round
        # did not count is shown with the reason.
        assert r["duration_s"] > 0 and r["fraction_averaged"] > 0.5
        assert set(r["participants"]) <= {1, 2} and r["participants"], r
        for uid in {1, 2} - set(r["participants"]):
            assert r["outcomes"][str(uid)] != "SUCCESS" and r["notes"].get(str(uid)), r
    # every honest miner is counted in some round, and is paid
    assert set().union(*(r["participants"] for r in doc["rounds"])) == {1, 2}, doc["rounds"]
    assert {m["kind"] for m in doc["miners"]} == {"honest"}
    for m in doc["miners"]:
        assert m["hotkey"].startswith("5") and len(m["hotkey"]) == 48  # real sr25519 ss58 addresses
        assert m["score"] > 0 and m["weight"] > 0, m
        assert m["outcome"] == doc["rounds"][-1]["outcomes"][str(m["uid"])]
    assert abs(sum(m["weight"] for m in doc["miners"]) - 1.0) < 1e-6
    loss = doc["loss"]
    assert len(loss["curve"]) == 3 and loss["end"] < loss["start"]


def test_stdout_is_one_json_document(sandbox):
    _, _, result = sandbox
    json.loads(result.stdout)  # nothing but the document on stdout
    assert "sandbox:" in result.stderr


def test_every_neuron_stopped_cleanly_and_nothing_is_left_running(sandbox):
    root, doc, _ = sandbox
    assert doc["exit_codes"] and all(code == 0 for code in doc["exit_codes"].values()), \
        (doc["exit_codes"], doc["stop_notes"])
    assert doc["stop_notes"] == {}
    assert _processes_mentioning(str(root)) == []  # no neuron, no p2pd (its -id= path lives under root)


def test_status_reads_the_sandbox_after_the_run(sandbox):
    root, doc, _ = sandbox
    result = run_dtrain("status", "--network", "sandbox", "--sandbox-dir", str(root), "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    by_uid = {m["uid"]: m for m in status["miners"]}
    assert set(by_uid) == {1, 2}
    for m in doc["miners"]:
        row = by_uid[m["uid"]]
        assert row["hotkey"] == m["hotkey"]
        assert row["api"].startswith("127.0.0.1:")
        assert row["peer_id"].startswith(("Qm", "12D3"))
        assert row["epoch"] == 2
        assert row["weight"] == pytest.approx(m["weight"])
    assert [v["uid"] for v in status["validators"]] == [0]
    assert len(status["rounds"]) == 2


def test_miners_pushed_each_round_to_the_local_store(sandbox):
    root, _, _ = sandbox
    tags = sorted(p.name for p in (root / "store" / "tags").iterdir())
    assert "sandbox.2.2" in tags and "sandbox.1.1" in tags
    assert (root / "store" / "tags" / "sandbox.2.2" / "config.json").is_file()


def test_push_command_uploads_a_sandbox_checkpoint(sandbox, tmp_path):
    root, _, _ = sandbox
    store = tmp_path / "store"
    result = run_dtrain("push", "--config", str(root / "neurons" / "miner1" / "config.toml"), "--repo", str(store),
                        "--json", env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["tag"] == "sandbox.2.2"
    assert (store / "tags" / "sandbox.2.2" / "config.json").is_file()
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(str(store / "tags" / "sandbox.2.2"))
    assert model.config.n_layer == 2
    # The same complete repo as the miners' own pushes, from the tokenizer and round facts the
    # miner saved with its checkpoint (offline: HF_HUB_OFFLINE above).
    tag_dir = store / "tags" / "sandbox.2.2"
    assert {"tokenizer.json", "tokenizer_config.json", "README.md"} <= {p.name for p in tag_dir.iterdir()}
    from huggingface_hub import ModelCard

    facts = ModelCard((tag_dir / "README.md").read_text()).data.to_dict()["dtrain"]
    assert facts["epoch"] == 2 and facts["tag"] == "sandbox.2.2"
    assert 1 <= facts["contributors"] <= 2 and facts["last_loss"] > 0 and facts["tokens_seen"] > 0


def test_status_without_a_sandbox_names_the_problem(tmp_path):
    result = run_dtrain("status", "--network", "sandbox", "--sandbox-dir", str(tmp_path / "nope"), "--json")
    assert result.returncode == 0
    doc = json.loads(result.stdout)
    assert "does not exist" in doc["chain_error"]


def test_newest_tag_loads_as_a_hugging_face_model_and_generates(sandbox):
    """The pushed model is usable by anyone: Auto classes and pipeline from the folder alone."""
    import math

    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    from dtrain.hub.local import LocalStore

    root, doc, _ = sandbox
    tag = LocalStore(root / "store").latest()
    assert tag == "sandbox.2.2"
    tag_dir = root / "store" / "tags" / tag
    model = AutoModelForCausalLM.from_pretrained(str(tag_dir), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(tag_dir), local_files_only=True)
    assert len(tok) == model.config.vocab_size > 1000  # not the empty vocabulary of a bare GPT2 config
    sentence = "The history of the world is a long story."
    assert tok.decode(tok(sentence)["input_ids"]) == sentence
    assert tok.model_max_length == model.config.n_positions == 128
    from tests.test_hub_model_repo import generation_complaints

    with generation_complaints() as complaints:
        generate = pipeline("text-generation", model=str(tag_dir), tokenizer=str(tag_dir))
        out = generate("The history of", max_new_tokens=8, do_sample=False)
    assert complaints == []  # no guessing of pad ids or lengths
    assert out[0]["generated_text"].startswith("The history of")
    assert len(tok(out[0]["generated_text"])["input_ids"]) > len(tok("The history of")["input_ids"])

    card = ModelCard((tag_dir / "README.md").read_text())
    meta = card.data.to_dict()
    assert meta["license"] == "mit" and meta["pipeline_tag"] == "text-generation"
    assert meta["library_name"] == "transformers" and {"dtrain", "bittensor", "subnet-38"} <= set(meta["tags"])
    facts = meta["dtrain"]
    assert (facts["run_id"], facts["epoch"], facts["tag"], facts["preset"]) == ("sandbox", 2, tag, "tiny")
    assert 1 <= facts["contributors"] <= 2  # the miners the last round averaged
    assert math.isfinite(facts["last_loss"]) and facts["last_loss"] > 0
    assert facts["tokens_seen"] > 0 and facts["parameters"] == model.num_parameters()
    assert facts["data"].startswith("local text")
    assert f'repo = "{tag_dir}"' in card.text and "unknown" not in card.text.split("Facts not recorded")[0]
