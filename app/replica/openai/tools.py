"""Tool calling on POST /v1/chat/completions: the request's tools, tool choice and history checked
against each other and the model, before any model work.

- **Tools** are OpenAI function tools. At most `max_tools` per request, their JSON at most
  `max_tools_bytes`, each name once, each `parameters` a valid JSON Schema (draft 2020-12 unless it
  names its own `$schema`); a tool list the constraint engine cannot compile is refused too. Each
  is a 400 naming the parameter (`tools[2].function.parameters`).
- **The model's format.** A model calls tools only when its chat template has a tool format
  Flywheel reads (policy/tool_format.py); otherwise `tools` is a 400 saying so. The prompt is the
  model's own template rendered with the tools.
- **`tool_choice`**: `none` (the tools are in the prompt, nothing is read as a call), `auto` (the
  default with tools: calls are read from what the model writes, never repaired), `required` or a
  named function: the completion is **constrained** to the format's call grammar
  (policy/constrain.py, compiled once per distinct tool list and cached), so even an untrained
  model calls a listed function with arguments that validate against its schema.
  `parallel_tool_calls` (default true) lets a required completion make several calls; a named
  choice makes exactly one. `required` or a name without tools, or a name not among them, is a 400.
- **History.** An assistant message's `tool_calls` need `arguments` that are a JSON object; a
  `tool` message must answer a call of an earlier assistant message that no tool message answered
  yet. `developer` messages are rendered as `system`.
- **The turn.** `turn` is how many assistant messages the history holds (0: the session's first
  call); the generation event records it with the session id, the tools' digest, the tool choice
  and whether the completion was constrained, so sessions can be assembled from the log.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from app.replica.config import ReplicaConfig
from app.replica.openai.errors import bad_param
from app.replica.openai.requests import ChatRequest, NamedToolChoice


@dataclass
class ToolPlan:
    """What a chat request asks of tool calling, checked."""

    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool objects
    choice: str = "none"  # none | auto | required | function
    function: str | None = None  # the named function when choice == "function"
    parallel: bool = True
    fmt: Any = None  # policy.tool_format.ToolFormat when tools are offered
    constraint: Any = None  # policy.constrain.CompiledGrammar for required / named
    digest: str | None = None  # sha256 of the tools' canonical JSON
    turn: int = 0
    # name -> its parameters' checked jsonschema validator, built once per request (calls are
    # validated on the generation thread, as they are read)
    validators: dict[str, Any] = field(default_factory=dict)

    @property
    def reads_calls(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]


def render_messages(req: ChatRequest) -> list[dict[str, Any]]:
    """The history as the chat templates take it (policy/base.py `apply_chat_template`), after
    checking calls and tool results against each other."""
    out: list[dict[str, Any]] = []
    pending: dict[str, int] = {}  # call id -> index of the assistant message that made it
    for i, msg in enumerate(req.messages):
        m: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role}
        content = getattr(msg, "content", None)
        m["content"] = (
            content
            if content is None or isinstance(content, str)
            else "".join(part.text for part in content)
        )
        if msg.role == "assistant" and msg.tool_calls:
            m["tool_calls"] = []
            for j, call in enumerate(msg.tool_calls):
                param = f"messages.[{i}].tool_calls.[{j}]"
                _check_arguments(call.function.arguments, f"{param}.function.arguments")
                if call.id in pending:
                    raise bad_param(f"{param}.id", f"tool call id {call.id!r} is used twice")
                pending[call.id] = i
                m["tool_calls"].append(call.model_dump())
        elif msg.role == "assistant" and content is None:
            raise bad_param(
                f"messages.[{i}].content", "an assistant message needs content or tool_calls"
            )
        if msg.role == "tool":
            if pending.pop(msg.tool_call_id, None) is None:
                raise bad_param(
                    f"messages.[{i}].tool_call_id",
                    f"tool_call_id {msg.tool_call_id[:100]!r} answers no tool call of an "
                    "earlier assistant message (or one already answered)",
                )
            m["tool_call_id"] = msg.tool_call_id
        out.append(m)
    return out


def _check_arguments(text: str, param: str) -> None:
    try:
        args = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise bad_param(param, f"the arguments are not JSON: {exc}") from None
    if not isinstance(args, dict):
        raise bad_param(param, "the arguments must be a JSON object")


def _check_tools(
    req: ChatRequest, cfg: ReplicaConfig
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The tools as dicts (absent parameters: an empty object schema) and a checked validator of
    each function's parameters, by name."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    if len(tools) > cfg.max_tools:
        raise bad_param("tools", f"{len(tools)} tools offered; at most {cfg.max_tools} are served")
    size = len(json.dumps(tools, ensure_ascii=False).encode())
    if size > cfg.max_tools_bytes:
        raise bad_param(
            "tools",
            f"the tools are {size} bytes of JSON; at most {cfg.max_tools_bytes} are served",
        )
    checked: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if fn["name"] in checked:
            raise bad_param(
                f"tools.[{i}].function.name", f"function {fn['name']!r} is offered twice"
            )
        fn.setdefault("parameters", {"type": "object", "properties": {}})
        checked[fn["name"]] = _validator(fn["parameters"], f"tools.[{i}].function.parameters")
    return tools, checked


def _validator(schema: dict[str, Any], param: str) -> Any:
    """A jsonschema validator of `schema`, once it is checked to be a valid object schema."""
    from jsonschema import Draft202012Validator, SchemaError, validators

    if schema.get("type", "object") != "object":
        raise bad_param(param, "a function's parameters must be a JSON Schema of type object")
    try:
        cls = validators.validator_for(schema, default=Draft202012Validator)
        cls.check_schema(schema)
        return cls(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "(root)"
        raise bad_param(param, f"not a valid JSON Schema at {where}: {exc.message}") from None
    except (RecursionError, ValueError) as exc:
        raise bad_param(param, f"not a valid JSON Schema: {exc}") from None


def _choice(req: ChatRequest, names: list[str]) -> tuple[str, str | None]:
    c = req.tool_choice
    if isinstance(c, NamedToolChoice):
        if c.function.name not in names:
            raise bad_param(
                "tool_choice",
                f"tool_choice names function {c.function.name[:100]!r}, which is not among the "
                f"tools ({', '.join(names[:20]) or 'none offered'})",
            )
        return "function", c.function.name
    if c is None:
        return ("auto" if names else "none"), None
    if c == "required" and not names:
        raise bad_param("tool_choice", "tool_choice 'required' needs tools")
    return c, None


def digest_of(tools: list[dict[str, Any]]) -> str:
    canon = json.dumps(tools, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode()).hexdigest()


async def plan_tools(req: ChatRequest, cfg: ReplicaConfig, tokenizer: Any) -> ToolPlan:
    """The request's tools checked against each other, the model and (for required / named) the
    constraint engine, which compiles the call grammar off the event loop."""
    from policy.tool_format import tool_format_for

    turn = sum(1 for m in req.messages if m.role == "assistant")
    if req.tools is None and req.tool_choice not in (None, "none", "auto"):
        raise bad_param("tool_choice", "tool_choice names a tool but no tools are offered")
    tools, checked = _check_tools(req, cfg)
    names = [t["function"]["name"] for t in tools]
    choice, function = _choice(req, names)
    plan = ToolPlan(tools=tools, choice=choice, function=function, turn=turn)
    plan.parallel = req.parallel_tool_calls is not False and choice != "function"
    if not tools:
        return plan
    plan.fmt = tool_format_for(tokenizer)
    if plan.fmt is None:
        raise bad_param(
            "tools",
            f"this model ({tokenizer.name}) has no tool-call format Flywheel reads in its chat "
            "template (docs/AGENTS.md lists the supported formats)",
        )
    plan.digest = digest_of(tools)
    plan.validators = checked
    if choice in ("required", "function"):
        plan.constraint = await asyncio.to_thread(_compile, plan, cfg, tokenizer)
    return plan


def _compile(plan: ToolPlan, cfg: ReplicaConfig, tokenizer: Any) -> Any:
    """The call grammar compiled for the model's tokenizer (cached by policy/constrain.py); a
    GrammarError (`tools[i].function.parameters: why`) is a 400 naming that parameter."""
    import time

    from app.replica import metrics as m
    from policy.constrain import GrammarError, GrammarLimits, cache_stats, compile_grammar

    t0, misses = time.perf_counter(), cache_stats()["misses"]
    try:
        grammar = plan.fmt.grammar(
            plan.tools, plan.function, plan.parallel, cfg.max_parallel_tool_calls
        )
        limits = GrammarLimits(
            initial_lexer_fuel=cfg.grammar_compile_fuel, step_lexer_fuel=cfg.grammar_step_fuel
        )
        compiled = compile_grammar(tokenizer, grammar, limits)
    except GrammarError as exc:
        where, sep, why = str(exc).partition(": ")
        param = (
            re.sub(r"\[(\d+)\]", r".[\1]", where) if sep and where.startswith("tools") else "tools"
        )
        raise bad_param(
            param, f"constrained decoding cannot enforce the tools: {why if sep else exc}"
        ) from None
    cache = "miss" if cache_stats()["misses"] > misses else "hit"
    m.GRAMMAR_COMPILE_SECONDS.labels(cfg.id, cache).observe(time.perf_counter() - t0)
    return compiled


def argument_error(plan: ToolPlan, name: str, arguments: str) -> str | None:
    """Why a call's arguments do not validate against its function's schema (None: they do)."""
    validator = plan.validators.get(name)
    if validator is None:
        return f"unknown function {name!r}"
    err = next(iter(validator.iter_errors(json.loads(arguments))), None)
    if err is None:
        return None
    where = "/".join(str(p) for p in err.absolute_path) or "(root)"
    return f"arguments at {where}: {err.message}"[:2000]
