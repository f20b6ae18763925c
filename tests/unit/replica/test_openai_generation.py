"""The pieces under the OpenAI-compatible routes: `generate(on_step=...)` never changes what is
sampled (a generation stopped early is a prefix of the full one, bit for bit), stop strings and
held-back text in `ChoiceText`, the byte tokenizer's chat template, and OpenAI's error shape."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.replica.bodies import RequestInvalid, parse_body
from app.replica.openai.choice_text import ChoiceText
from app.replica.openai.errors import from_invalid
from app.replica.openai.requests import ChatRequest, CompletionRequest, _strip_neutral
from policy.tokenizer import ByteTokenizer
from tests.unit.controller.unigram import UnigramPolicy


def _tiny(tiny):
    from policy import build_policy

    cfg, state = tiny(3)
    policy = build_policy(cfg)
    policy.load_serving_state_dict(state)
    return policy


def _bits(xs: list[float]) -> list[int]:
    return torch.tensor(xs, dtype=torch.float32).view(torch.int32).tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_generation_stopped_by_on_step_is_a_bit_exact_prefix_of_the_full_one(tiny, temperature):
    policy = _tiny(tiny)
    prompts = [list(b"def f(x):"), list(b"def f(x):")]
    full = policy.generate(prompts, max_tokens=20, temperature=temperature, seed=11)
    seen: list[tuple[int, list]] = []

    def on_step(step: int, tokens: list) -> bool:
        seen.append((step, list(tokens)))
        return step < 6  # stop after step 6 (7 tokens per row)

    part = policy.generate(
        prompts, max_tokens=20, temperature=temperature, seed=11, on_step=on_step
    )
    for f, p in zip(full, part):
        k = len(p.tokens)
        assert k == min(7, len(f.tokens))
        assert p.tokens == f.tokens[:k] and _bits(p.logprobs) == _bits(f.logprobs[:k])
        assert np.array_equal(p.routes, f.routes[:k])
    assert [s for s, _ in seen] == list(range(len(seen)))
    for row in range(2):  # the callback saw each row's tokens in order, then None once it ended
        got = [toks[row] for _, toks in seen if toks[row] is not None]
        assert got == part[row].tokens
    if all(len(f.tokens) > 7 for f in full):
        assert all(p.meta["finish_reason"] == "stopped" for p in part)


def test_a_callback_that_always_continues_changes_nothing(tiny):
    policy = _tiny(tiny)
    full = policy.generate([list(b"ab")] * 3, max_tokens=12, seed=5)
    same = policy.generate([list(b"ab")] * 3, max_tokens=12, seed=5, on_step=lambda s, t: True)
    assert [s.tokens for s in same] == [s.tokens for s in full]
    assert [_bits(s.logprobs) for s in same] == [_bits(s.logprobs) for s in full]


def test_the_unigram_test_policy_honours_on_step_exactly():
    policy = UnigramPolicy()
    full = policy.generate([[1], [2]], max_tokens=10, seed=3)
    part = policy.generate([[1], [2]], max_tokens=10, seed=3, on_step=lambda s, t: s < 3)
    for f, p in zip(full, part):
        assert p.tokens == f.tokens[: len(p.tokens)] and len(p.tokens) <= 4
        assert p.logprobs == f.logprobs[: len(p.tokens)]


def _feed(c: ChoiceText, text: bytes) -> list[str]:
    return [c.add(b) for b in text]


def test_stop_strings_end_the_text_before_them_and_nothing_of_them_is_streamed():
    tok = ByteTokenizer()
    c = ChoiceText(tok, ["\n\n", "END"], max_tokens=100)
    deltas = _feed(c, b"abc\nde\nfEN")
    assert c.ended is None
    assert "".join(deltas) == "abc\nde\nf"  # "EN" may start "END": held back
    assert c.add(ord("D")) == "" and c.ended == "stop" and c.text == "abc\nde\nf"
    assert len(c.tokens) == len("abc\nde\nfEND")  # the tokens generated, stop string included
    c2 = ChoiceText(tok, ["\n\n"], max_tokens=100)
    assert "".join(_feed(c2, b"x\n")) == "x" and c2.add(ord("y")) == "\ny" and c2.ended is None


def test_an_incomplete_character_is_held_back_until_its_bytes_arrive():
    tok = ByteTokenizer()
    c = ChoiceText(tok, [], max_tokens=100)
    euro = "€".encode()
    assert _feed(c, b"a" + euro[:2]) == ["a", "", ""]
    assert c.add(euro[2]) == "€"
    assert c.add(tok.eos_id) == "" and c.ended == "stop" and c.text == "a€"


def test_length_and_a_cut_off_character_at_the_end():
    tok = ByteTokenizer()
    c = ChoiceText(tok, [], max_tokens=3)
    out = _feed(c, b"a" + "€".encode()[:2])
    assert c.ended == "length" and "".join(out) == "a\ufffd" == c.text


def test_the_byte_tokenizer_chat_template():
    tok = ByteTokenizer()
    assert tok.has_chat_template
    got = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    )
    assert got == "system: Be brief.\nuser: hi\nassistant: "


@pytest.mark.parametrize(
    "raw, model, param",
    [
        (b'{"prompt": "x", "temperature": NaN}', CompletionRequest, "temperature"),
        (b'{"prompt": "x", "n": 1.5}', CompletionRequest, "n"),
        (b'{"prompt": "x", "stream": "yes"}', CompletionRequest, "stream"),
        (b'{"prompt": "x", "frobnicate": 1}', CompletionRequest, "frobnicate"),
        (b'{"prompt": ["x", "y"]}', CompletionRequest, "prompt"),
        (b'{"max_tokens": 3}', CompletionRequest, "prompt"),
        (
            b'{"messages": [{"role": "tool", "content": "x"}]}',
            ChatRequest,
            "messages.[0].tool_call_id",
        ),
        (b'{"messages": [{"role": "robot", "content": "x"}]}', ChatRequest, "messages.[0].role"),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            ChatRequest,
            "messages.[0].content",
        ),
        (b'{"messages": [{"role": "user", "content": 5}]}', ChatRequest, "messages.[0].content"),
        (b'{"messages": []}', ChatRequest, "messages"),
        (
            b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
            ChatRequest,
            "messages.[0].content",
        ),
        (b'{"prompt": "x", "user": ""}', CompletionRequest, "user"),
        (b'{"prompt": "x", "stop": "\\udc00"}', CompletionRequest, "stop"),
        (b'{"prompt": "x", "stop": ["a", 5]}', CompletionRequest, "stop"),
    ],
)
def test_invalid_bodies_become_openai_errors_naming_the_parameter(raw, model, param):
    with pytest.raises(RequestInvalid) as exc:
        parse_body(raw, model)
    err = from_invalid(exc.value)
    assert err.status == 400 and err.param == param
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "obj, param",
    [
        ({"top_p": 0.9}, "top_p"),
        ({"top_p": True}, "top_p"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"best_of": 2}, "best_of"),
        ({"echo": True}, "echo"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_unsupported_parameters_are_refused_unless_neutral(obj, param):
    from app.replica.openai.errors import OpenAIError

    with pytest.raises(OpenAIError) as exc:
        _strip_neutral({"prompt": "x", **obj})
    assert exc.value.param == param and exc.value.status == 400
    neutral = {"top_p": 1, "presence_penalty": 0.0, "logit_bias": {}, "best_of": 1, "echo": False}
    assert _strip_neutral({"prompt": "x", **neutral, "functions": None}) == {"prompt": "x"}
