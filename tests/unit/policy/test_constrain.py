"""policy/constrain.py: tool-call grammars, their compile cache, and constrained generation on
untrained policies (the built-in byte-level MoE and a tiny Hugging Face Llama with its BPE
tokenizer): whatever random weights propose, the text is a Hermes tool call whose arguments
validate against the function's schema, and the behaviour log-probs are of the masked softmax."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from policy.constrain import (
    ConstraintError,
    GrammarError,
    GrammarLimits,
    cache_stats,
    clear_cache,
    compile_grammar,
    tool_call_grammar,
)
from policy.sampling import generate

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {  # its items are a $defs reference: resolved against this schema, its own root
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/small"}, "b": {"$ref": "#/$defs/small"}},
    "required": ["a", "b"],
    "additionalProperties": False,
    "$defs": {"small": {"type": "integer", "minimum": -99, "maximum": 99}},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
]
CALL = re.compile(r'<tool_call>\n(\{"name":.*?\}\})\n</tool_call>', re.DOTALL)


@pytest.fixture
def builtin_policy(tiny_config):
    from policy import build_policy

    torch.manual_seed(0)
    return build_policy({**tiny_config, "max_context": 512}).eval()


@pytest.fixture
def hf_llama(hf_llama_dir):
    from policy import build_policy

    return build_policy({"type": "hf", "model_dir": str(hf_llama_dir)}).eval()


def calls_in(text: str) -> list[dict]:
    """The Hermes tool calls that make up `text` exactly, parsed, each {"name", "arguments"}."""
    bodies = CALL.findall(text)
    expect = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in bodies)
    assert bodies and text == expect, f"not a sequence of Hermes tool calls: {text!r}"
    return [json.loads(b) for b in bodies]


def check_call(call: dict, allowed: list[str]) -> None:
    assert list(call) == ["name", "arguments"], f"keys {list(call)}"
    assert call["name"] in allowed, f"{call['name']!r} not in {allowed}"
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call["name"]]
    jsonschema.validate(call["arguments"], schema)


def prompts_for(policy, n: int) -> list[list[int]]:
    return [policy.tokenizer.encode(f"user: call a tool ({i})\nassistant: ") for i in range(n)]


# ------------------------------------------------------------------ constrained generation


@pytest.mark.parametrize("which", ["builtin", "hf"])
@pytest.mark.parametrize("choice", [None, "add"])
def test_an_untrained_policy_emits_one_valid_tool_call_then_eos(which, choice, request):
    policy = request.getfixturevalue("builtin_policy" if which == "builtin" else "hf_llama")
    compiled = compile_grammar(policy.tokenizer, tool_call_grammar(TOOLS, choice, parallel=False))
    allowed = ["get_weather", "add"] if choice is None else [choice]
    seen = set()
    for seed in range(3 if which == "builtin" else 2):
        prompts = prompts_for(policy, 3)
        constraint = compiled.start(len(prompts))
        samples = policy.generate(prompts, 200, 1.0, seed=seed, constraint=constraint)
        for s in samples:
            assert s.meta["finish_reason"] == "eos", f"seed {seed}: {s.text!r}"
            assert s.tokens[-1] == policy.tokenizer.eos_id
            (call,) = calls_in(s.text)
            check_call(call, allowed)
            seen.add(call["name"])
    assert seen <= set(allowed) and seen, seen


def test_parallel_calls_are_one_or_more_each_valid(builtin_policy):
    compiled = compile_grammar(builtin_policy.tokenizer, tool_call_grammar(TOOLS, None, True))
    counts = []
    for seed in range(4):
        prompts = prompts_for(builtin_policy, 3)
        samples = builtin_policy.generate(
            prompts, 400, 1.0, seed=seed, constraint=compiled.start(3)
        )
        for s in samples:
            assert s.meta["finish_reason"] == "eos", f"seed {seed}: {s.text!r}"
            calls = calls_in(s.text)
            for call in calls:
                check_call(call, ["get_weather", "add"])
            counts.append(len(calls))
    assert min(counts) >= 1 and max(counts) >= 2, f"calls per completion: {counts}"


class Recording:
    """A Constraint as generate drives it, keeping the model's logits and the masked ones."""

    def __init__(self, inner) -> None:
        self.inner, self.logits, self.masked = inner, [], []

    def mask_logits(self, step: int, logits: torch.Tensor) -> torch.Tensor:
        out = self.inner.mask_logits(step, logits)
        self.logits.append(logits.clone())
        self.masked.append(out.clone())
        return out

    def accept(self, step: int, tokens: list[int | None]) -> None:
        self.inner.accept(step, tokens)


@pytest.mark.parametrize("which", ["builtin", "hf"])
def test_behaviour_logprobs_are_of_the_masked_distribution(which, request):
    """exp(behaviour log-prob) of every sampled token is its probability under softmax(masked
    logits), it had mass there, and the gap to the unmasked model's log-prob is -log Z >= 0 (Z: the
    mass the mask left)."""
    policy = request.getfixturevalue("builtin_policy" if which == "builtin" else "hf_llama")
    compiled = compile_grammar(policy.tokenizer, tool_call_grammar(TOOLS, None, False))
    prompts = prompts_for(policy, 3)
    rec = Recording(compiled.start(3))
    samples = generate(policy, prompts, 200, 1.0, seed=7, constraint=rec, top_logprobs=3)
    masked_somewhere = 0
    for i, s in enumerate(samples):
        for t, (tok, lp) in enumerate(zip(s.tokens, s.logprobs)):
            masked_p = torch.softmax(rec.masked[t][i], -1)
            assert masked_p[tok] > 0, f"row {i} step {t}: token {tok} was masked out"
            assert lp == pytest.approx(float(masked_p[tok].log()), abs=2e-5), (i, t)
            unmasked = float(torch.log_softmax(rec.logits[t][i], -1)[tok])
            log_z = float(torch.logsumexp(torch.log_softmax(rec.logits[t][i], -1)[masked_p > 0], 0))
            assert lp - unmasked == pytest.approx(-log_z, abs=2e-5), (i, t)
            assert lp >= unmasked - 1e-6
            masked_somewhere += int(log_z < -1e-3)
            top_ids = [j for j, _ in s.top_logprobs[t]]
            assert all(masked_p[j] > 0 or v == -torch.inf for j, v in s.top_logprobs[t]), top_ids
    assert masked_somewhere > 0, "the mask never removed any mass"


def test_the_same_seed_gives_the_same_constrained_generation(builtin_policy):
    compiled = compile_grammar(builtin_policy.tokenizer, tool_call_grammar(TOOLS, None, True))
    prompts = prompts_for(builtin_policy, 2)

    def run(seed: int):
        out = builtin_policy.generate(prompts, 300, 1.0, seed=seed, constraint=compiled.start(2))
        return [(s.tokens, s.logprobs) for s in out]

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_generate_refuses_a_mask_and_a_constraint_at_once(builtin_policy):
    compiled = compile_grammar(builtin_policy.tokenizer, tool_call_grammar(TOOLS, None, False))
    with pytest.raises(ValueError, match="not both"):
        generate(
            builtin_policy,
            prompts_for(builtin_policy, 1),
            4,
            constraint=compiled.start(1),
            mask_logits=lambda step, logits: logits,
        )


# ------------------------------------------------------------------ the Constraint itself


def test_ids_past_the_tokenizer_and_ended_rows_are_masked(builtin_policy):
    """Logits wider than the vocabulary (an HF model's padding rows) keep those ids at -inf; a row
    that has ended may only repeat eos; a token the grammar refuses raises."""
    tok = builtin_policy.tokenizer
    constraint = compile_grammar(tok, tool_call_grammar(TOOLS, "add", False)).start(2)
    logits = torch.zeros(2, tok.vocab_size + 7)
    out = constraint.mask_logits(0, logits)
    assert torch.isinf(out[:, tok.vocab_size :]).all()
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [ord("<")]
    constraint.accept(0, [ord("<"), None])
    out = constraint.mask_logits(1, logits)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [ord("t")]
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [tok.eos_id]
    with pytest.raises(ConstraintError, match="row 0 at step 1: the matcher failed on token 120"):
        constraint.accept(1, [ord("x"), None])


# ------------------------------------------------------------------ grammars and the cache


def test_the_grammar_writes_json_as_json_dumps_does_with_name_then_arguments():
    g = tool_call_grammar(TOOLS, "get_weather", False)
    assert g.startswith("start: call\n") and "args_0: %json" in g and "args_1" not in g
    assert '"whitespace_flexible": false' in g
    assert 'tool_0: "{\\"name\\": \\"get_weather\\", \\"arguments\\": " args_0 "}"' in g
    assert '"item_separator": ", "' in g and '"key_separator": ": "' in g
    assert tool_call_grammar(TOOLS, None, True).startswith('start: call ("\\n" call){0,7}\n')
    assert tool_call_grammar(TOOLS, None, True, max_calls=3).startswith(
        'start: call ("\\n" call){0,2}\n'
    )


def test_object_schemas_that_do_not_say_allow_no_other_properties():
    """An untrained model cannot pad arguments with keys no function reads; what it writes still
    validates against the schema as the client wrote it."""
    params = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}},
        "$defs": {"open": {"type": "object", "additionalProperties": True}},
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    line = next(ln for ln in tool_call_grammar(tools, None, False).splitlines() if "%json" in ln)
    schema = json.loads(line.split("%json ", 1)[1])
    assert schema["additionalProperties"] is False
    assert schema["properties"]["a"]["additionalProperties"] is False
    assert schema["$defs"]["open"]["additionalProperties"] is True  # said: kept


def test_a_repeated_grammar_hits_the_cache_and_is_not_recompiled(builtin_policy):
    from policy.tokenizer import ByteTokenizer

    clear_cache()
    g = tool_call_grammar(TOOLS, None, False)
    first = compile_grammar(builtin_policy.tokenizer, g)
    assert cache_stats() == {"hits": 0, "misses": 1, "size": 1}
    again = compile_grammar(builtin_policy.tokenizer, g)
    assert again is first and cache_stats() == {"hits": 1, "misses": 1, "size": 1}
    other = compile_grammar(ByteTokenizer(), g)  # another tokenizer object: its own entry
    assert other is not first and cache_stats() == {"hits": 1, "misses": 2, "size": 2}
    compile_grammar(builtin_policy.tokenizer, g, GrammarLimits(step_max_items=10_000))
    assert cache_stats()["misses"] == 3  # other limits: compiled under them


def test_a_schema_llguidance_cannot_compile_is_a_grammar_error_naming_the_tool(builtin_policy):
    tok = builtin_policy.tokenizer
    broken = {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}
    tools = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": broken}}]
    with pytest.raises(GrammarError, match=r"^tools\[1\]\.function\.parameters: .*'/nope'"):
        compile_grammar(tok, tool_call_grammar(tools, None, False))
    unsupported = {"type": "object", "unevaluatedProperties": False}
    tools = [{"type": "function", "function": {"name": "f", "parameters": unsupported}}]
    with pytest.raises(GrammarError, match=r"^tools\[0\]\.function\.parameters: .*unevaluated"):
        compile_grammar(tok, tool_call_grammar(tools, "f", False))


def test_bad_tool_lists_are_grammar_errors_naming_the_parameter():
    with pytest.raises(GrammarError, match=r"^tools: .*at least one"):
        tool_call_grammar([], None, False)
    with pytest.raises(GrammarError, match=r"^tool_choice\.function\.name: no function 'nope'"):
        tool_call_grammar(TOOLS, "nope", False)
    with pytest.raises(GrammarError, match=r'^tools\[1\]\.type: only "function"'):
        tool_call_grammar([TOOLS[0], {"type": "retrieval"}], None, False)
    no_name = {"type": "function", "function": {"parameters": WEATHER}}
    with pytest.raises(GrammarError, match=r"^tools\[0\]\.function\.name: "):
        tool_call_grammar([no_name], None, False)
    not_a_schema = {"type": "function", "function": {"name": "f", "parameters": [1]}}
    with pytest.raises(GrammarError, match=r"^tools\[0\]\.function\.parameters: must be"):
        tool_call_grammar([not_a_schema], None, False)


def test_a_grammar_over_the_size_limit_is_refused_before_compiling(builtin_policy):
    wide = {"type": "object", "properties": {f"p{i:04d}": {"type": "integer"} for i in range(3000)}}
    g = tool_call_grammar(
        [{"type": "function", "function": {"name": "f", "parameters": wide}}], None, False
    )
    assert len(g) > 65536, len(g)
    before = cache_stats()["misses"]
    with pytest.raises(
        GrammarError, match=r"^tools: the tool-call grammar is \d+ bytes, over .*65536"
    ):
        compile_grammar(builtin_policy.tokenizer, g)
    assert cache_stats()["misses"] == before
    small = tool_call_grammar(TOOLS, None, False)
    with pytest.raises(GrammarError, match="over the limit of 100"):
        compile_grammar(builtin_policy.tokenizer, small, GrammarLimits(max_grammar_bytes=100))


def test_masks_from_llguidances_thread_pool_equal_the_row_loops(builtin_policy, monkeypatch):
    """Large vocabularies compute their rows' masks on llguidance's pool (PARALLEL_VOCAB): forced
    on for byte-v1 here, the generation is the same bit for bit."""
    import policy.constrain as constrain

    compiled = compile_grammar(builtin_policy.tokenizer, tool_call_grammar(TOOLS, None, True))
    prompts = prompts_for(builtin_policy, 3)

    def run():
        out = builtin_policy.generate(prompts, 200, 1.0, seed=3, constraint=compiled.start(3))
        return [(s.tokens, s.logprobs) for s in out]

    looped = run()
    monkeypatch.setattr(constrain, "PARALLEL_VOCAB", 0)
    assert run() == looped


def test_a_call_with_no_free_choice_is_forced_byte_for_byte_with_the_name_unescaped(
    builtin_policy,
):
    """No arguments allowed and one function: every token is forced, the name in raw UTF-8 (as a
    chat template's tojson writes it), each forced token's behaviour log-prob 0."""
    empty = {"type": "object", "properties": {}, "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "météo", "parameters": empty}}]
    compiled = compile_grammar(builtin_policy.tokenizer, tool_call_grammar(tools, "météo", False))
    (s,) = builtin_policy.generate(
        prompts_for(builtin_policy, 1), 80, 1.0, seed=0, constraint=compiled.start(1)
    )
    assert s.text == '<tool_call>\n{"name": "météo", "arguments": {}}\n</tool_call>', repr(s.text)
    assert s.tokens[-1] == builtin_policy.tokenizer.eos_id and s.logprobs == [0.0] * len(s.tokens)


def test_a_parser_limit_hit_mid_generation_raises_instead_of_unmasking(builtin_policy):
    """llguidance's per-step item budget (GrammarLimits.step_max_items) set below what the
    arguments need: the matcher fails, and so does the generation, naming the row and step."""
    g = tool_call_grammar(TOOLS, "add", False)
    compiled = compile_grammar(builtin_policy.tokenizer, g, GrammarLimits(step_max_items=5))
    with pytest.raises(ConstraintError, match=r"^row 0 at step \d+: .*Too many items \(limit 5"):
        builtin_policy.generate(
            prompts_for(builtin_policy, 1), 80, seed=0, constraint=compiled.start(1)
        )
