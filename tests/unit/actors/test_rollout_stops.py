"""Stop-string and EOS trimming shared by the engines, and the sampling-params contract."""

from __future__ import annotations

import pytest

from actors.engines.hf import trim_generation
from actors.engines.protocol import STOP_STRINGS, GenerationResult, SamplingParams, find_stop


def enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_find_stop_picks_the_stop_that_ends_first():
    assert find_stop("<search>a</search> then <answer>b</answer>", STOP_STRINGS) == "</search>"
    assert find_stop("<answer>b</answer><search>a</search>", STOP_STRINGS) == "</answer>"
    assert find_stop("<search>a</sear", STOP_STRINGS) is None


def test_trim_keeps_the_token_completing_the_stop_and_drops_the_rest(tok):
    head = enc(tok, "<search> capital of Peru </search>")
    tail = enc(tok, " and more text")
    ids = head + tail
    n, reason, stop = trim_generation(ids, [0.0] * len(ids), tok, {tok.eos_token_id}, STOP_STRINGS)
    assert (n, reason, stop) == (len(head), "stop", "</search>")
    assert tok.decode(ids[:n]).endswith("</search>")
    assert "</search>" not in tok.decode(ids[: n - 1])


def test_trim_at_first_eos_inclusive(tok):
    ids = [*enc(tok, "Lima."), tok.eos_token_id, tok.eos_token_id, tok.eos_token_id]  # padded row
    n, reason, stop = trim_generation(ids, [0.0] * len(ids), tok, {tok.eos_token_id}, STOP_STRINGS)
    assert (n, reason, stop) == (len(ids) - 2, "eos", None)


def test_stop_after_eos_is_ignored(tok):
    ids = [*enc(tok, "Lima"), tok.eos_token_id, *enc(tok, "<answer>x</answer>")]
    n, reason, _ = trim_generation(ids, [0.0] * len(ids), tok, {tok.eos_token_id}, STOP_STRINGS)
    assert (n, reason) == (len(enc(tok, "Lima")) + 1, "eos")


def test_no_stop_no_eos_is_length(tok):
    ids = enc(tok, "<think> still thinking")
    assert trim_generation(ids, [0.0] * len(ids), tok, {tok.eos_token_id}, STOP_STRINGS) == (
        len(ids),
        "length",
        None,
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 4, "temperature": -0.1}, "temperature"),
        ({"max_new_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 4, "stop": ("",)}, "stop"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_generation_result_checks_alignment():
    with pytest.raises(ValueError, match="differ in length"):
        GenerationResult([1, 2], [-0.1], "length", None, 0)
    with pytest.raises(ValueError, match="stop_string"):
        GenerationResult([1], [-0.1], "stop", None, 0)
