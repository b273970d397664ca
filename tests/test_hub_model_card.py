"""The model card: pure rendering, checked by huggingface_hub's own metadata parser."""

from __future__ import annotations

import math

import pytest
from huggingface_hub import ModelCard

from dtrain.hub.model_card import LICENSE, TAGS, CardFacts, card_metadata, contributors_of, render_model_card
from dtrain.swarm.records import Outcome, PeerResult, RoundRecord


def _facts(**kw) -> CardFacts:
    base = dict(tag="sn38.12.300", run_id="sn38", epoch=12, inner_step=300, repo_id="alice/sn38",
                tokens_seen=1_572_864, last_loss=3.14159, contributors=5, round_id="ab12cd34",
                round_tokens=262_144, preset="gpt2-250m", param_count=249_412_608, context_length=1024,
                vocab_size=50257, tokenizer="distilgpt2", dataset="HuggingFaceFW/fineweb",
                dataset_config="sample-350BT", dtrain_version="0.1.0")
    base.update(kw)
    return CardFacts(**base)


def test_metadata_round_trips_through_huggingface_hub():
    card = ModelCard(render_model_card(_facts()))
    data = card.data.to_dict()
    assert data["license"] == LICENSE == "mit"
    assert data["language"] == ["en"]
    assert data["library_name"] == "transformers"
    assert data["pipeline_tag"] == "text-generation"
    assert data["datasets"] == ["HuggingFaceFW/fineweb"]
    assert set(TAGS) <= set(data["tags"]) and {"bittensor", "subnet-38", "gpt2"} <= set(data["tags"])
    assert data["dtrain"] == card_metadata(_facts())["dtrain"]
    d = data["dtrain"]
    assert (d["run_id"], d["epoch"], d["tag"], d["tokens_seen"], d["contributors"]) == \
        ("sn38", 12, "sn38.12.300", 1_572_864, 5)
    assert d["last_loss"] == pytest.approx(3.14159)
    # the card survives a save/load cycle unchanged
    assert ModelCard(str(card)).data.to_dict() == data


def test_body_states_the_facts_and_how_to_load():
    text = render_model_card(_facts())
    body = ModelCard(text).text
    for fact in ("`sn38.12.300`", "`sn38`", "| 12 |", "1,572,864", "3.1416",
                 "| Contributing miners in the last round | 5 |", "gpt2-250m", "249,412,608", "distilgpt2", "HuggingFaceFW/fineweb", "sample-350BT", "`ab12cd34`"):
        assert fact in body, fact
    assert 'repo, revision = "alice/sn38", "sn38.12.300"' in body
    assert "AutoModelForCausalLM.from_pretrained(repo, revision=revision)" in body
    assert "AutoTokenizer.from_pretrained(repo, revision=revision)" in body
    assert "1024 tokens" in body
    assert "unknown" not in body.split("Facts not recorded")[0]


def test_unknown_facts_say_unknown_and_are_null_in_metadata():
    f = CardFacts(tag="r.1.1", run_id="r", epoch=1, inner_step=1, local_path="/srv/store/tags/r.1.1",
                  data_description="local text (the sample corpus shipped with dtrain)")
    text = render_model_card(f)
    card = ModelCard(text)
    d = card.data.to_dict()
    assert "datasets" not in d  # local text has no Hub dataset page to link
    assert d["dtrain"]["contributors"] is None and d["dtrain"]["last_loss"] is None
    assert d["dtrain"]["data"] == "local text (the sample corpus shipped with dtrain)"
    assert "| Contributing miners in the last round | unknown |" in text
    assert "| Last training loss (pushing miner, before this step) | unknown |" in text
    assert "| Tokens seen by the pushing miner | unknown |" in text
    assert 'repo = "/srv/store/tags/r.1.1"' in text and "revision" not in text.split("```python")[1].split("```")[0]


def test_non_finite_loss_is_unknown_and_odd_strings_stay_strings():
    f = _facts(last_loss=math.nan, tokenizer="weird: name # with 'quotes' and \"more\"", preset="no",
               initial_weights="openai-community/gpt2")
    card = ModelCard(render_model_card(f))
    d = card.data.to_dict()
    assert d["dtrain"]["last_loss"] is None
    assert d["dtrain"]["tokenizer"] == "weird: name # with 'quotes' and \"more\""
    assert d["dtrain"]["preset"] == "no"  # not YAML's boolean
    assert "base_model" not in d  # the Hub refuses one that is not a Hub model; a path would be
    assert d["dtrain"]["initial_weights"] == "openai-community/gpt2"
    assert "initial weights from openai-community/gpt2" in card.text
    # started from a Hub model: its own licence applies too, and the card says so
    assert "weights of `openai-community/gpt2`, whose own licence also applies" in card.text
    assert "whose own licence" not in render_model_card(_facts())
    assert "datasets" not in card_metadata(_facts(dataset="/data/fineweb-copy"))  # a path is no Hub id
    assert "| Last training loss (pushing miner, before this step) | unknown |" in card.text


def test_facts_survive_a_dict_round_trip():
    f = _facts(extra_tags=("sandbox",))
    assert CardFacts.from_dict({**f.to_dict(), "future_field": 1}) == f
    assert "sandbox" in card_metadata(f)["tags"]


def test_contributors_are_miners_with_weight_in_a_successful_part():
    rec = RoundRecord(round_id="g", local_peer_id="a", started_at=0.0, duration_s=1.0, peers=[
        PeerResult("a", Outcome.SUCCESS, 64, 64),
        PeerResult("b", Outcome.SUCCESS, 64, 32),
        PeerResult("validator", Outcome.SUCCESS, 0, 0),  # validators join with weight 0
        PeerResult("c", Outcome.FAIL, 64, 0),
        PeerResult("d", Outcome.WRONG_MODEL, 64, 0),
    ])
    assert contributors_of(rec) == 2
    assert contributors_of(RoundRecord.from_dict(rec.to_dict())) == 2
    assert contributors_of(RoundRecord(round_id="", local_peer_id="a", started_at=0.0, duration_s=0.0)) == 0
