"""Constrained decoding for tool calls: a grammar mask on the built-in engine's sampling loop.

What: when a chat request says `tool_choice: "required"` or names a function, the completion must
be a tool call whose arguments validate against the function's JSON schema, even from a model
never trained to call tools. The format is Hermes / Qwen2.5's:

    <tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>      (then the model's eos)

with one or more calls separated by "\\n" when parallel calls are allowed.

How: `tool_call_grammar` writes an llguidance Lark grammar (text: the vLLM engine hands the same
text to vLLM's structured outputs, which run the same llguidance version, pinned in pyproject.toml)
in which each function's `parameters` schema is its own `%json` root (so its `$ref`s resolve as
written) with whitespace fixed: one space after each `,` and `:` and nowhere else, as Python's
`json.dumps` and the chat templates' `tojson` write JSON (so the call reads back, and renders in
the next turn's history, exactly as generated), and an untrained model cannot spin on spaces.
`compile_grammar` compiles it for a tokenizer once (an LRU cache keyed by the tokenizer and the
text); `CompiledGrammar.start(n)` copies its pristine matcher per row into a `Constraint`, which
`policy/sampling.py` calls each step: `mask_logits` sets the tokens the grammar does not allow to
-inf, `accept` advances each row's matcher by the token it sampled.

Why the mask is the sampling distribution: the log-probs logged as behaviour are those of the
masked softmax, the one sampled from (docs/NUMERICS.md, "Constrained decoding", has what that means
for a trainer scoring the unmasked model).

    grammar = tool_call_grammar(tools, choice=None, parallel=False)   # GrammarError on a bad schema
    constraint = compile_grammar(policy.tokenizer, grammar).start(len(prompts))
    samples = policy.generate(prompts, 256, constraint=constraint)
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
import torch

MAX_PARALLEL_CALLS = 8  # calls one constrained completion may make with parallel_tool_calls
CACHE_SIZE = 256  # compiled grammars kept (LRU), over all tokenizers
# x-guidance options of every arguments schema: json.dumps' separators, no other whitespace
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ARGS_RULE = re.compile(r"args_(\d+): %json ")
_ERROR_AT = re.compile(r"^at (\d+)\(\d+\): ")
_EXCERPT = re.compile(r"\n *\d+ \|")


class GrammarError(ValueError):
    """A tool list, schema or grammar that cannot be compiled, is too large or exceeds a limit. The
    message starts with the request parameter at fault (e.g. `tools[1].function.parameters: ...`)
    so the replica can return it as OpenAI's 400 naming that parameter."""


class ConstraintError(RuntimeError):
    """A row's matcher failed mid-generation (a parser limit hit computing a mask or taking a
    token, or a token the mask did not allow): the generation cannot go on constrained, and is
    never unmasked."""


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on what one grammar may cost. The parser limits default to llguidance's own (the ones
    vLLM compiles with), so a grammar accepted by one engine is accepted by the other."""

    # the grammar text's UTF-8 size; larger -> GrammarError before llguidance sees it
    max_grammar_bytes: int = 65536
    # Earley items in one parser row: the grammar's branching (ambiguity) at one position
    max_items_in_row: int = 2000
    # lexer fuel to build the regexes at compile (~50k/ms): bounds compile time
    initial_lexer_fuel: int = 1_000_000
    # lexer fuel of one token's mask (~14k/ms): bounds per-token mask time
    step_lexer_fuel: int = 200_000
    # Earley items one mask step may create (~20k/ms): bounds per-token mask time
    step_max_items: int = 50_000
    # distinct lexer states, built lazily (~1-2 kB each): bounds a generation's memory
    max_lexer_states: int = 250_000
    # symbols in the grammar's productions: bounds compile time and memory
    max_grammar_size: int = 500_000

    def parser_limits(self) -> llguidance.LLParserLimits:
        """These limits as llguidance's, with short errors (no grammar echoed into a 400)."""
        return llguidance.LLParserLimits(
            max_items_in_row=self.max_items_in_row,
            initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states,
            max_grammar_size=self.max_grammar_size,
            verbose_errors=False,
        )


# ------------------------------------------------------------------ the grammar


def tool_call_grammar(
    tools: list[dict],
    choice: str | None,
    parallel: bool,
    *,
    open_tag: str = "<tool_call>\n",
    close_tag: str = "\n</tool_call>",
    max_calls: int = MAX_PARALLEL_CALLS,
) -> str:
    """The Lark grammar of one tool call (`parallel`: one to `max_calls`, separated by "\\n") to
    any of `tools` (OpenAI function tools; `choice` None, tool_choice "required") or to the function
    named `choice`. Each call is `open_tag` + `{"name": NAME, "arguments": ARGS}` + `close_tag`,
    ARGS JSON in `JSON_OPTIONS`' layout valid under that function's `parameters` (absent: an object
    with no properties), where an object schema that does not say `additionalProperties` allows
    none: the arguments still validate against the schema as written, and the model cannot pad
    them with keys no function reads (OpenAI's strict mode asks for the same). Rule `args_<i>` is
    tools[i]'s schema, one line each, so a compile error names the tool."""
    assert max_calls >= 1, f"max_calls must be >= 1, got {max_calls}"
    if not isinstance(tools, list) or not tools:
        raise GrammarError("tools: a tool call needs at least one function tool")
    names = [_function_name(i, t) for i, t in enumerate(tools)]
    if choice is None:
        picked = list(range(len(tools)))
    elif choice in names:
        picked = [names.index(choice)]
    else:
        raise GrammarError(f"tool_choice.function.name: no function {choice!r} in tools")
    call = f"call: {_lark_str(open_tag)} ({' | '.join(f'tool_{i}' for i in picked)}) "
    lines = [
        f'start: call ("\\n" call){{0,{max_calls - 1}}}' if parallel else "start: call",
        call + _lark_str(close_tag),
    ]
    for i in picked:
        head = json.dumps({"name": names[i]}, ensure_ascii=False)[:-1]
        head += ', "arguments": '
        lines.append(f'tool_{i}: {_lark_str(head)} args_{i} "}}"')
        lines.append(f"args_{i}: %json {json.dumps(_arguments_schema(i, tools[i]))}")
    return "\n".join(lines) + "\n"


def _function_name(i: int, tool: Any) -> str:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise GrammarError(f'tools[{i}].type: only "function" tools can be called')
    fn = tool.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise GrammarError(f"tools[{i}].function.name: must be a non-empty string")
    return name


def _arguments_schema(i: int, tool: dict) -> dict:
    """tools[i]'s parameters schema with the layout options at its root."""
    params = tool["function"].get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise GrammarError(f"tools[{i}].function.parameters: must be a JSON Schema object")
    return {**_closed(params), "x-guidance": dict(JSON_OPTIONS)}


def _closed(node: Any) -> Any:
    """`node` with `additionalProperties: false` on every object schema that does not say."""
    if isinstance(node, list):
        return [_closed(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _closed(v) for k, v in node.items()}
    is_object = node.get("type") == "object" or "properties" in node
    if is_object and "additionalProperties" not in node and "patternProperties" not in node:
        out["additionalProperties"] = False
    return out


def _lark_str(s: str) -> str:
    """`s` as a Lark string literal (JSON's escapes)."""
    return json.dumps(s)


# ------------------------------------------------------------------ tokenizers and the cache

_LL_TOKENIZERS: weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_CACHE: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
_LOCK = threading.Lock()
_STATS = {"hits": 0, "misses": 0}


class _ByteTokens:
    """byte-v1 (policy/tokenizer.py) as llguidance's TokenizerWrapper wants it: each id's bytes."""

    def __init__(self, tok: Any) -> None:
        self.eos_token_id, self.bos_token_id = tok.eos_id, tok.bos_id
        self.tokens = [bytes([i]) for i in range(256)] + [b"<|bos|>", b"<|eos|>", b"<|pad|>"]
        self.special_token_ids = [tok.bos_id, tok.eos_id, tok.pad_id]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def ll_tokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for a policy's (built once per tokenizer object, ~1 s for a large
    Hugging Face vocabulary): byte-v1's 259 ids, or an HFTokenizer's fast tokenizer over
    max(model rows, tokens) ids as vLLM builds it."""
    with _LOCK:
        found = _LL_TOKENIZERS.get(tokenizer)
    if found is not None:
        return found
    if getattr(tokenizer, "name", None) == "byte-v1":
        built = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens(tokenizer)))
    elif hasattr(tokenizer, "hf"):
        from llguidance.hf import from_tokenizer

        n = max(int(tokenizer.vocab_size), len(tokenizer.hf))
        built = from_tokenizer(tokenizer.hf, n_vocab=n, eos_token=int(tokenizer.eos_id))
    else:
        raise TypeError(f"no llguidance tokenizer for {type(tokenizer).__name__}")
    assert built.eos_token == tokenizer.eos_id, f"eos {built.eos_token} != {tokenizer.eos_id}"
    with _LOCK:
        return _LL_TOKENIZERS.setdefault(tokenizer, built)


def compile_grammar(
    tokenizer: Any, grammar: str, limits: GrammarLimits = GrammarLimits()
) -> CompiledGrammar:
    """`grammar` compiled for `tokenizer` under `limits`, from the LRU cache when this tokenizer
    object compiled this text before; raises GrammarError with llguidance's reason otherwise. The
    check is the matcher's own: building it validates the grammar (no second compile)."""
    size = len(grammar.encode())
    if size > limits.max_grammar_bytes:
        raise GrammarError(
            f"tools: the tool-call grammar is {size} bytes, over the limit of "
            f"{limits.max_grammar_bytes} (smaller parameters schemas or fewer tools)"
        )
    ll = ll_tokenizer(tokenizer)
    key = (id(ll), grammar, limits)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None and hit.ll_tokenizer is ll:
            _CACHE.move_to_end(key)
            _STATS["hits"] += 1
            return hit
        _STATS["misses"] += 1
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0, limits=limits.parser_limits())
    if matcher.is_error():
        raise GrammarError(_explain(grammar, matcher.get_error()))
    compiled = CompiledGrammar(grammar, ll, matcher, _n_tokens(tokenizer))
    with _LOCK:
        _CACHE[key] = compiled
        _CACHE.move_to_end(key)
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    return compiled


def cache_stats() -> dict[str, int]:
    """The compile cache's hits, misses and entries since the process started (or `clear_cache`)."""
    with _LOCK:
        return {**_STATS, "size": len(_CACHE)}


def clear_cache() -> None:
    """Drop every compiled grammar and zero the counters (a benchmark's cold compile)."""
    with _LOCK:
        _CACHE.clear()
        _STATS.update(hits=0, misses=0)


def _explain(grammar: str, error: str) -> str:
    """llguidance's error ("at LINE(COL): reason\\n<grammar excerpt>") as `param: reason`, the
    parameter being tools[i].function.parameters when the line is tool i's `args_i` rule."""
    head = _EXCERPT.split(error)[0]  # the excerpt (numbered grammar lines) would echo the schema
    first = " ".join(x.strip() for x in head.split("\n") if x.strip().strip("^"))
    at = _ERROR_AT.match(first)
    reason = first[at.end() :] if at else first
    if at:
        lines = grammar.split("\n")
        line = lines[int(at.group(1)) - 1] if 0 < int(at.group(1)) <= len(lines) else ""
        rule = _ARGS_RULE.match(line)
        if rule:
            return f"tools[{rule.group(1)}].function.parameters: {reason}"
    return f"tools: the tool-call grammar does not compile: {reason}"


def _matcher_error(matcher: Any) -> str:
    """A failed matcher's error on one line (without llguidance's non-verbose marker)."""
    text = matcher.get_error().replace("<non-verbose/>", "")
    return " ".join(x.strip() for x in text.split("\n") if x.strip())


def _n_tokens(tokenizer: Any) -> int:
    """Ids that are tokens (an HF model's logits may have more rows: padding, never sampled)."""
    hf = getattr(tokenizer, "hf", None)
    return len(hf) if hf is not None else int(tokenizer.vocab_size)


# ------------------------------------------------------------------ per generation


class CompiledGrammar:
    """A grammar compiled for one tokenizer; `start` gives each generation its own matchers."""

    def __init__(self, grammar: str, ll: Any, matcher: Any, n_tokens: int) -> None:
        self.grammar = grammar
        self.ll_tokenizer = ll
        self.n_tokens = n_tokens  # ids past it are disallowed whatever the grammar says
        self._pristine = matcher  # never advanced: copied per row

    def start(self, n_rows: int) -> Constraint:
        assert n_rows >= 1, f"n_rows must be >= 1, got {n_rows}"
        return Constraint(self, [self._pristine.deep_copy() for _ in range(n_rows)])


_EXECUTOR: list[Any] = []  # llguidance.LLExecutor, built on first use
# vocabularies from this size get their rows' masks on llguidance's thread pool; below it a plain
# loop is faster (byte-v1, 8 rows: 0.03 ms a step in a loop, 0.11 ms through the pool)
PARALLEL_VOCAB = 32768


class Constraint:
    """One generation's grammar state, one matcher per row, driven by policy/sampling.py:
    `mask_logits(step, logits)` then `accept(step, tokens)` for step 0, 1, ... in turn."""

    def __init__(self, compiled: CompiledGrammar, matchers: list[Any]) -> None:
        self.grammar = compiled.grammar  # what the vLLM engine sends instead of masking itself
        self._n_tokens = compiled.n_tokens
        self._eos = int(compiled.ll_tokenizer.eos_token)
        self._matchers = matchers
        self._ended = [False] * len(matchers)  # sampled eos (or given None): only eos from now
        width = (compiled.ll_tokenizer.vocab_size + 31) // 32
        self._bits = np.zeros((len(matchers), width), dtype=np.uint32)
        self._base = self._bits.ctypes.data  # llguidance writes the masks here
        self._step = 0  # the step mask_logits expects next

    def mask_logits(self, step: int, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [B, V] with every token the row's grammar does not allow next at -inf (an
        ended row: all but eos); raises ConstraintError if a row's matcher failed."""
        b, v = logits.shape
        assert b == len(self._matchers), f"{b} rows of logits, {len(self._matchers)} matchers"
        assert step == self._step, f"mask_logits(step={step}) where step {self._step} is next"
        bits = self._bits  # one bit per llguidance token id, little-endian words
        bits[:] = 0
        live = [(m, i) for i, m in enumerate(self._matchers) if not self._ended[i]]
        if len(live) > 1 and self._n_tokens >= PARALLEL_VOCAB:
            if not _EXECUTOR:
                _EXECUTOR.append(llguidance.LLExecutor())
            _EXECUTOR[0].unsafe_compute_mask_ptr(live, self._base, bits.shape[1] * 4, b)
        else:
            for m, i in live:
                m.unsafe_compute_mask_ptr(self._base + i * bits.strides[0], bits.shape[1] * 4)
        for m, i in live:
            if m.is_error():
                raise ConstraintError(f"row {i} at step {step}: {_matcher_error(m)}")
        for i in (i for i, ended in enumerate(self._ended) if ended):
            bits[i, self._eos >> 5] = 1 << (self._eos & 31)
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        n = min(v, self._n_tokens)
        keep = torch.zeros((b, v), dtype=torch.bool)
        keep[:, :n] = torch.from_numpy(allowed[:, :n].view(np.bool_))
        empty = (~keep.any(dim=1)).nonzero().flatten().tolist()
        if empty:
            raise ConstraintError(f"row {empty[0]} at step {step}: the grammar allows no token")
        return logits.masked_fill(~keep, -torch.inf)

    def accept(self, step: int, tokens: list[int | None]) -> None:
        """Advance each row's matcher by the token it sampled at `step` (None: it had ended)."""
        assert step == self._step, f"accept(step={step}) after mask_logits of step {self._step}"
        assert len(tokens) == len(self._matchers), (
            f"{len(tokens)} tokens, {len(self._matchers)} rows"
        )
        for i, (m, t) in enumerate(zip(self._matchers, tokens)):
            if t is None or self._ended[i]:
                self._ended[i] = True
                continue
            if not m.consume_token(int(t)):
                raise ConstraintError(
                    f"row {i} at step {step}: the matcher failed on token {t}: {_matcher_error(m)}"
                )
            self._ended[i] = int(t) == self._eos
        self._step += 1
