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
