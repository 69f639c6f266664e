"""Sampling parameters as a client sends them: lists become tuples, bad values one clear line."""

from __future__ import annotations

import pytest

from neuron_buckets.engine.sampling_params import SamplingParams


def test_lists_from_json_become_tuples_and_one_stop_string_a_tuple_of_one():
    params = SamplingParams(stop_token_ids=[5, 6], stop="###")
    assert params.stop_token_ids == (5, 6) and params.stop == ("###",)
    assert hash(params) == hash(SamplingParams(stop_token_ids=(5, 6), stop=("###",)))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be an integer of at least 1, got 0"),
        ({"max_tokens": 2.0}, "max_tokens must be an integer of at least 1, got 2.0"),
        ({"temperature": -0.1}, "temperature must be at least 0, got -0.1"),
        ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\], got 1.5"),
        ({"repetition_penalty": 0}, "repetition_penalty must be above 0, got 0"),
        ({"top_k": -1}, r"top_k must be an integer of at least 0 \(0 = off\), got -1"),
        ({"top_k": True}, r"top_k must be an integer of at least 0 \(0 = off\), got True"),
        ({"seed": "7"}, "seed must be an integer or None, got '7'"),
        ({"stop_token_ids": [3, -1]}, r"stop_token_ids must be non-negative integers, got \[-1\]"),
        ({"stop": ["ok", ""]}, r"stop strings must be non-empty strings, got \[''\]"),
        ({"ignore_eos": 1}, "ignore_eos must be true or false, got 1"),
        ({"speculative": "no"}, "speculative must be true or false, got 'no'"),
    ],
)
def test_a_value_out_of_range_is_one_line(fields, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        SamplingParams(**fields)
