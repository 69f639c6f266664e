"""Sampling parameters as a client sends them: lists become tuples, bad values one clear line."""

from __future__ import annotations

import pytest

from neuron_buckets.engine.sampling_params import SamplingParams


def test_lists_from_json_become_tuples_and_one_stop_string_a_tuple_of_one():
    params = SamplingParams(stop_token_ids=[5, 6], stop="###")
    assert params.stop_token_ids == (5, 6) and params.stop == ("###",)
    assert hash(params) == hash(SamplingParams(stop_token_ids=(5, 6), stop=("###",)))


TOP_K = r"top_k must be an integer in \[0, 2\*\*63\) \(0 = off\), got "
SEED = r"seed must be an integer in \[-2\*\*63, 2\*\*64\) or None, got "
STOP_IDS = r"stop_token_ids must be integers in \[0, 2\*\*63\), got "
STOP = "stop: at most 64 strings of 4096 characters in all, got "


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
        ({"top_k": -1}, TOP_K + r"-1"),
        ({"top_k": True}, TOP_K + r"True"),
        ({"top_k": 2**63}, TOP_K + r"9223372036854775808"),
        ({"seed": "7"}, SEED + r"'7'"),
        ({"seed": 2**64}, SEED + r"18446744073709551616"),
        ({"stop_token_ids": [3, -1]}, STOP_IDS + r"\[-1\]"),
        ({"stop_token_ids": [2**63]}, STOP_IDS + r"\[9223372036854775808\]"),
        ({"stop": ["ok", ""]}, r"stop strings must be non-empty strings, got \[''\]"),
        ({"ignore_eos": 1}, "ignore_eos must be true or false, got 1"),
        ({"min_tokens": -1}, r"min_tokens must be an integer in \[0, max_tokens=16\], got -1"),
        ({"max_tokens": 4, "min_tokens": 5}, r"min_tokens must be an integer in \[0, max_tokens=4\], got 5"),
        ({"min_tokens": 1.0}, r"min_tokens must be an integer in \[0, max_tokens=16\], got 1.0"),
        ({"speculative": "no"}, "speculative must be true or false, got 'no'"),
        ({"stop": ["ab"] * 65}, STOP + "65 with 130 characters"),
        ({"stop": ["x" * 4000, "y" * 97]}, STOP + "2 with 4097 characters"),
        ({"stop": "x" * (1 << 20)}, STOP + "1 with 1048576 characters"),
    ],
)
def test_a_value_out_of_range_is_one_line(fields, message):
    """Integers beyond 64 bits (probe 1) overflowed in the sampler, inside a step."""
    with pytest.raises(ValueError, match=f"^{message}$"):
        SamplingParams(**fields)
