// The official `openai` npm client against a real Flywheel replica (started by
// tests/integration/replica/test_openai_node.py, which also reads the generation events back from
// Kafka). Reads FLYWHEEL_REPLICA_URL, FLYWHEEL_REPLICA_KEY, FLYWHEEL_MODEL and writes what it got
// (ids, texts, finish reasons) as JSON to FLYWHEEL_RESULT_FILE for the driver to compare.
import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import { after, test } from "node:test";
import OpenAI from "openai";

function env(name) {
  const v = process.env[name];
  if (!v) throw new Error(`${name} is not set: run this through tests/integration/replica/test_openai_node.py`);
  return v;
}

const client = new OpenAI({
  baseURL: `${env("FLYWHEEL_REPLICA_URL")}/v1`,
  apiKey: env("FLYWHEEL_REPLICA_KEY"),
  maxRetries: 0,
  timeout: 60_000,
});
const model = env("FLYWHEEL_MODEL");
const results = {};
after(() => writeFileSync(env("FLYWHEEL_RESULT_FILE"), JSON.stringify(results)));

test("the served model is listed", async () => {
  const ids = [];
  for await (const m of client.models.list()) ids.push(m.id);
  assert.deepEqual(ids, [model]);
});

test("a completion", async () => {
  const out = await client.completions.create({ model, prompt: "def add(a, b):", max_tokens: 8, user: "node-1" });
  assert.equal(out.object, "text_completion");
  assert.equal(out.choices.length, 1);
  assert.equal(out.choices[0].request_id, out.id);
  assert.ok(["stop", "length"].includes(out.choices[0].finish_reason));
  results.completion = { id: out.id, text: out.choices[0].text, finish_reason: out.choices[0].finish_reason };
});

test("a streamed completion", async () => {
  const stream = await client.completions.create({
    model, prompt: "class A:", max_tokens: 12, user: "node-2", stream: true,
    stream_options: { include_usage: true },
  });
  let text = "";
  let finish = null;
  let id = null;
  let usage = null;
  for await (const chunk of stream) {
    assert.equal(chunk.object, "text_completion");
    id = chunk.id;
    for (const c of chunk.choices) {
      text += c.text;
      finish = c.finish_reason ?? finish;
    }
    if (chunk.usage) usage = chunk.usage;
  }
  assert.ok(["stop", "length"].includes(finish));
  assert.ok(usage && usage.completion_tokens >= 1);
  results.stream = { id, text, finish_reason: finish, completion_tokens: usage.completion_tokens };
});

test("a streamed chat completion", async () => {
  const stream = await client.chat.completions.create({
    model, messages: [{ role: "user", content: "hello" }], max_tokens: 10, user: "node-3", stream: true,
  });
  let content = "";
  let finish = null;
  let id = null;
  let role = null;
  for await (const chunk of stream) {
    assert.equal(chunk.object, "chat.completion.chunk");
    id = chunk.id;
    const c = chunk.choices[0];
    role = role ?? c.delta.role ?? null;
    content += c.delta.content ?? "";
    finish = c.finish_reason ?? finish;
  }
  assert.equal(role, "assistant");
  assert.ok(["stop", "length"].includes(finish));
  results.chat = { id, text: content, finish_reason: finish };
});

test("an unsupported parameter is a BadRequestError naming it", async () => {
  await assert.rejects(
    client.completions.create({ model, prompt: "x", max_tokens: 2, user: "node-4", top_p: 0.5 }),
    (err) => err instanceof OpenAI.BadRequestError && err.param === "top_p",
  );
});

// Tool calling. The tiny untrained model calls a tool only when the request makes it: a named
// tool_choice or "required" is enforced by constrained decoding, so the arguments validate.
const FILES = { "notes.txt": "the answer is 42\n", "todo.txt": "water the plants\n" };
const tools = [
  {
    type: "function",
    function: {
      name: "read_file",
      description: "Read one of the user's files",
      parameters: {
        type: "object",
        properties: { name: { type: "string", enum: Object.keys(FILES) } },
        required: ["name"],
        additionalProperties: false,
      },
    },
  },
];
const ask = { role: "user", content: "What is the answer in my notes?" };

function checkArguments(text) {
  const args = JSON.parse(text);
  assert.deepEqual(Object.keys(args), ["name"]);
  assert.ok(Object.hasOwn(FILES, args.name), text);
  return args;
}

test("a named tool call, then its result in the next turn", async () => {
  const first = await client.chat.completions.create({
    model, messages: [ask], tools, tool_choice: { type: "function", function: { name: "read_file" } },
    max_tokens: 160, user: "node-tools-1",
  });
  const choice = first.choices[0];
  assert.equal(choice.finish_reason, "tool_calls");
  assert.equal(choice.message.tool_calls.length, 1);
  const call = choice.message.tool_calls[0];
  assert.equal(call.type, "function");
  assert.equal(call.function.name, "read_file");
  const args = checkArguments(call.function.arguments);
  results.tool_named = { id: first.id, call_id: call.id, arguments: call.function.arguments };

  const second = await client.chat.completions.create({
    model,
    messages: [
      ask,
      choice.message, // the assistant message as returned, tool_calls and all
      { role: "tool", tool_call_id: call.id, content: FILES[args.name] },
    ],
    tools, max_tokens: 16, user: "node-tools-1",
  });
  assert.equal(second.choices[0].message.role, "assistant");
  assert.ok(["stop", "length", "tool_calls"].includes(second.choices[0].finish_reason));
  results.tool_result = { id: second.id, file: args.name };
});

test("a required tool call, streamed through the SDK's stream helper", async () => {
  const stream = client.chat.completions.stream({
    model, messages: [ask], tools, tool_choice: "required", parallel_tool_calls: false,
    max_tokens: 160, user: "node-tools-2", stream_options: { include_usage: true },
  });
  const done = [];
  let deltas = "";
  stream.on("tool_calls.function.arguments.delta", (e) => { deltas += e.arguments_delta; });
  stream.on("tool_calls.function.arguments.done", (e) => done.push(e));
  const final = await stream.finalChatCompletion();
  const choice = final.choices[0];
  assert.equal(choice.finish_reason, "tool_calls");
  assert.equal(choice.message.tool_calls.length, 1);
  const call = choice.message.tool_calls[0];
  assert.equal(call.function.name, "read_file");
  checkArguments(call.function.arguments);
  assert.ok(call.id.startsWith("call_"), call.id);
  assert.equal(done.length, 1);
  assert.equal(done[0].name, "read_file");
  assert.equal(done[0].arguments, call.function.arguments);
  assert.equal(deltas, call.function.arguments);
  assert.ok(final.usage && final.usage.completion_tokens >= 1);
  results.tool_stream = {
    id: final.id, call_id: call.id, arguments: call.function.arguments,
    completion_tokens: final.usage.completion_tokens,
  };
});
