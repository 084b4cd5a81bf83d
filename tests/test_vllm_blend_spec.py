"""Blend requests for vLLM (engine_adapter/vllm/blend.py): parameters validated, prompts built as
``BlendEngine`` splits them. Pure Python: runs in the main suite, no vLLM needed."""

from __future__ import annotations

import pytest

from blend.engine import DEFAULT_SEPARATOR, split_prompt
from engine_adapter.loader import find_smollm2_gguf, gguf_config
from engine_adapter.vllm.blend import BLEND_PARAM, BlendSpec, blend_request, blend_spec


@pytest.fixture(scope="module")
def tokenizer():
    return gguf_config(find_smollm2_gguf())[1]


def test_no_blend_parameters_mean_no_blend():
    assert blend_spec(None, 10) is None
    assert blend_spec({}, 10) is None
    assert blend_spec({"other": 1}, 10) is None


@pytest.mark.parametrize("spec, match", [
    ([3, 4], "must be an object"),
    ({"lengths": []}, "lengths must be a list"),
    ({"lengths": [1, "2"]}, "lengths must be a list"),
    ({"lengths": [True, 2]}, "lengths must be a list"),
    ({"lengths": [-1, 2]}, "prefix must be >= 0"),
    ({"lengths": [2, 0]}, "every passage > 0"),
    ({"lengths": [4, 6]}, "query needs at least one"),
    ({"lengths": [1, 2], "ratio": 1.5}, "ratio must be a number"),
    ({"lengths": [1, 2], "ratio": True}, "ratio must be a number"),
    ({"lengths": [1, 2], "ratio": "most"}, "ratio must be a number"),
    ({"lengths": [1, 2], "selector": "nope"}, "selector 'nope' is unknown"),
    ({"lengths": [1, 2], "lenghts": [1]}, "unknown keys"),
])
def test_malformed_blend_parameters_are_refused_in_one_line(spec, match):
    with pytest.raises(ValueError, match=match) as info:
        blend_spec({BLEND_PARAM: spec}, 10)
    assert "\n" not in str(info.value)


def test_blend_spec_cuts_the_prompt_into_its_parts():
    spec = blend_spec({BLEND_PARAM: {"lengths": [2, 3, 1], "ratio": 0.3, "selector": "sinks"}}, 9)
    assert spec == BlendSpec((2, 3, 1), 0.3, "sinks") and spec.cached_tokens == 6
    assert spec.parts(range(9)) == ([0, 1], [[2, 3, 4], [5]], [6, 7, 8])
    assert blend_spec({BLEND_PARAM: {"lengths": [0, 4], "ratio": "auto"}}, 5).ratio == "auto"


def test_blend_request_tokenizes_each_part_as_blend_engine_does(tokenizer):
    text = DEFAULT_SEPARATOR.join(["You answer from passages.", "Alpha is a town in Mercia.",
                                   "Beta was founded in 1200.", "Q: where is Alpha?"])
    ids, params = blend_request(tokenizer, text, ratio=0.15)
    split = split_prompt(tokenizer, text)
    spec = blend_spec(params, len(ids))
    assert spec.parts(ids) == (split.prefix, split.chunks, split.query)
    assert spec.ratio == 0.15 and spec.selector is None
    with pytest.raises(ValueError, match="no .* in the prompt"):
        blend_request(tokenizer, "no marker at all")
