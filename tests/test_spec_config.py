"""--speculative-config: vLLM's JSON shape read into a frozen config, clear errors otherwise;
the n-gram lookup it configures."""

from __future__ import annotations

import pytest

from cpud.engine.spec_ngram import NgramIndex
from cpud.settings import setting
from cpud.settings.config import EngineArgs
from cpud.settings.errors import ConfigError
from cpud.settings.speculative import SpeculativeConfig, parse_speculative_config


def test_ngram_config_from_text_and_dict():
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    config = parse_speculative_config(text)
    assert config == SpeculativeConfig("ngram", 3, 2, 4, 8)
    assert parse_speculative_config(config.to_json()) == config
    as_dict = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3}
    assert parse_speculative_config(as_dict) == SpeculativeConfig("ngram", 2, 3, 5, 8)
    vllm_spelling = {"model": "[ngram]", "method": "ngram", "num_speculative_tokens": 1}
    assert parse_speculative_config(vllm_spelling).num_speculative_tokens == 1
    assert parse_speculative_config(None) is None
    assert (
        "4 proposed tokens"
        in parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4}).describe()
    )


@pytest.mark.parametrize(
    "value, words",
    [
        ("{method: ngram}", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"method": "medusa2", "num_speculative_tokens": 2}', 'method must be "ngram"'),
        ('{"method": "eagle", "model": "x", "num_speculative_tokens": 2}', "not supported"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', 'needs "model"'),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "at least 1"),
        ('{"method": "ngram", "num_speculative_tokens": 2.5}', "whole number"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "whole number"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 6, '
            '"prompt_lookup_max": 3}',
            "above prompt_lookup_max",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}', "unknown key"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}', "least"),
    ],
)
def test_bad_speculative_config_is_a_config_error_naming_the_flag(value, words):
    with pytest.raises(ConfigError, match="--speculative-config") as caught:
        parse_speculative_config(value)
    assert words in str(caught.value)


def test_setting_and_engine_args_carry_it():
    item = setting("speculative_config")
    assert "--speculative-config" in item.flags and item.default is None
    assert EngineArgs(speculative_config='{"method": "ngram"}').speculative_config


def test_ngram_lookup_prefers_the_longest_latest_match():
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # [2, 3] (and [1, 2, 3] not: the end is [5, 2, 3]) last occurred before 7 8 ...
    assert index.propose(tokens, 3) == [7]  # a fresh match proposes one token
    tokens += [7]
    # 3-gram [2, 3, 7] occurred once, followed by 8 5 2 3 7
    assert index.propose(tokens, 2) == [8, 5]
    assert index.propose(tokens, 10) == [8, 5, 2, 3, 7]  # up to the sequence's end


def test_ngram_lookup_without_match_or_room_proposes_nothing():
    index = NgramIndex(2, 4)
    assert index.propose([1, 2, 3, 4, 5], 4) == []
    assert index.propose([1, 2], 4) == []
    index = NgramIndex(2, 4)
    assert index.propose([1, 2, 1, 2], 0) == []
    assert index.propose([1, 2, 1, 2], 1) == [1]


def test_doctor_item_shows_the_configuration():
    from types import SimpleNamespace

    from cpud.doctor.spec_check import spec_check

    text = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4}).to_json()
    check = spec_check(SimpleNamespace(config=SimpleNamespace(speculative_config=text)))
    assert check.status == "ok" and check.summary.startswith("ngram, 4 proposed tokens")
    assert check.value["prompt_lookup_max"] == 5 and check.value["disable_by_batch_size"] == 8
