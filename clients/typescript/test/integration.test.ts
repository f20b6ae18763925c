/**
 * The client against the real ingest API on a real Kafka broker.
 *
 * Started by tests/integration/clients/test_typescript_client.py (`make test` runs it), which
 * serves two APIs on a broker of its own and a small control plane, and passes them in:
 *
 *   FLYWHEEL_TEST_API_URL, FLYWHEEL_TEST_API_KEY              the API with the default limits
 *   FLYWHEEL_TEST_SMALL_API_URL, FLYWHEEL_TEST_SMALL_API_KEY  the API with small body/event limits
 *   FLYWHEEL_TEST_SMALL_MAX_EVENT_BYTES                       that API's max_event_bytes
 *   FLYWHEEL_TEST_CONTROL_URL   POST /broker/stop, POST /broker/start,
 *                               GET /interactions?api=main|small (every record of the API's
 *                               interactions topic: [{key, value_b64}])
 *
 * The tests run one at a time (one of them stops the broker).
 */

import assert from "node:assert/strict";
import { after, describe, test } from "node:test";

import {
  DeliveryError,
  EVENT_SCHEMAS,
  EVENT_TYPES,
  FeedbackClient,
  generationEvent,
  type EventType,
  type FeedbackClientOptions,
  type FeedbackEvent,
  type FieldSchema,
} from "@flywheel/feedback-client";

function env(name: string): string {
  const value = process.env[name];
  if (!value) {
    throw new Error(
      `${name} is not set: these tests run against the real API and Kafka broker; run them with ` +
        "`.venv/bin/python -m pytest tests/integration/clients/test_typescript_client.py` (make test does)",
    );
  }
  return value;
}

const MAIN = { url: env("FLYWHEEL_TEST_API_URL"), key: env("FLYWHEEL_TEST_API_KEY") };
const SMALL = { url: env("FLYWHEEL_TEST_SMALL_API_URL"), key: env("FLYWHEEL_TEST_SMALL_API_KEY") };
const SMALL_MAX_EVENT_BYTES = Number(env("FLYWHEEL_TEST_SMALL_MAX_EVENT_BYTES"));
const CONTROL = env("FLYWHEEL_TEST_CONTROL_URL");

interface KafkaRecord {
  key: string;
  value: Buffer;
}

async function control(method: "GET" | "POST", path: string): Promise<unknown> {
  const resp = await fetch(`${CONTROL}${path}`, { method });
  const text = await resp.text();
  assert.equal(resp.status, 200, `control plane ${method} ${path}: ${resp.status} ${text}`);
  return JSON.parse(text);
}

async function interactions(api: "main" | "small"): Promise<KafkaRecord[]> {
  const rows = (await control("GET", `/interactions?api=${api}`)) as Array<{ key: string; value_b64: string }>;
  return rows.map((r) => ({ key: r.key, value: Buffer.from(r.value_b64, "base64") }));
}

/** Records of the topic by event_id (each id may appear more than once: delivery is at least once). */
async function byEventId(api: "main" | "small"): Promise<Map<string, KafkaRecord[]>> {
  const out = new Map<string, KafkaRecord[]>();
  for (const record of await interactions(api)) {
    const id = (JSON.parse(record.value.toString("utf8")) as { event_id: string }).event_id;
    out.set(id, [...(out.get(id) ?? []), record]);
  }
  return out;
}

function clientFor(
  api: { url: string; key: string },
  extra: Partial<FeedbackClientOptions> = {},
): { client: FeedbackClient; errors: DeliveryError[] } {
  const errors: DeliveryError[] = [];
  const client = new FeedbackClient({
    baseUrl: api.url,
    apiKey: api.key,
    flushIntervalMs: 0,
    onError: (e) => errors.push(e),
    ...extra,
  });
  return { client, errors };
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));
const session = (name: string) => `${name}-${globalThis.crypto.randomUUID().slice(0, 8)}`;

/** Poll `condition` every 200 ms until it holds, failing after `timeoutMs` (a bound, not a threshold). */
async function until(what: string, condition: () => boolean, timeoutMs = 60_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!condition()) {
    assert.ok(Date.now() < deadline, `timed out after ${timeoutMs} ms waiting for ${what}`);
    await sleep(200);
  }
}

describe("against the real API and Kafka", () => {
  const clients: FeedbackClient[] = [];
  after(async () => {
    await Promise.all(clients.map((c) => c.dispose()));
  });

  test("the OpenAPI document's event schemas are exactly EVENT_SCHEMAS", async () => {
    const resp = await fetch(`${MAIN.url}/openapi.json`);
    assert.equal(resp.status, 200);
    const doc = (await resp.json()) as OpenApi;
    COMPONENTS = doc.components.schemas as { [name: string]: JsonSchema };
    const items = doc.paths["/v1/events"]?.post?.requestBody?.content?.["application/json"]?.schema?.properties
      ?.events?.items;
    assert.ok(items?.discriminator, "POST /v1/events publishes no event schema (app/api/routes/events.py)");
    assert.equal(items.discriminator.propertyName, "type");
    const mapping = items.discriminator.mapping;
    assert.deepEqual(Object.keys(mapping).sort(), [...EVENT_TYPES].sort(), "event types differ");
    for (const type of EVENT_TYPES) {
      const ref = mapping[type];
      assert.ok(ref !== undefined && ref.startsWith("#/components/schemas/"), `unexpected $ref ${ref}`);
      const schema = doc.components.schemas[ref.slice("#/components/schemas/".length)];
      assert.ok(schema, `${ref} is not in the document`);
      assert.equal(schema.additionalProperties, false, `${type}: unknown fields must be refused`);
      const fields = Object.fromEntries(
        Object.entries(schema.properties).map(([name, p]) => [name, normalise(p, `${type}.${name}`)]),
      );
      const ours = EVENT_SCHEMAS[type as EventType];
      assert.deepEqual(fields, ours.fields, `${type}: the fields differ from the API's`);
      assert.deepEqual([...schema.required].sort(), [...ours.required].sort(), `${type}: required differs`);
    }
  });

  test("events posted by the client are on the topic byte for byte as sent", async () => {
    const posted: string[] = [];
    const { client, errors } = clientFor(MAIN, {
      fetch: (input, init) => {
        posted.push(String(init?.body));
        return fetch(input, init);
      },
    });
    clients.push(client);
    const ref = { requestId: session("req"), sessionId: session("bytes"), modelVersion: "3" };
    const generation = generationEvent({
      ...ref,
      promptTokens: [72, 105, 0],
      completionTokens: [33],
      logprobs: [-0.0625],
      temperature: 0.8,
      routes: "AQAAAA==", // one int32 expert id, shape [1, 1, 1]
      routeShape: [1, 1, 1],
      groupId: "group-1",
      latencyMs: 12.5,
      finishReason: "cancelled",
      stream: true,
    });
    const ids = [
      client.send(generation),
      client.accept(ref),
      client.reject(ref),
      client.editPersistence({ ...ref, fraction: 0.75, afterS: 30 }),
      client.rating({ ...ref, value: -1 }),
      client.toolError({ ...ref, message: 'naïve "quote" \\ back\nslash — ✓ 𝄞', hint: "check x", tokenIndex: 0 }),
      client.followup({ ...ref, sentiment: 0.25 }),
      client.sessionOutcome({ ...ref, outcome: "abandoned" }),
    ];
    await client.flush();
    assert.deepEqual(errors, []);
    assert.equal(posted.length, 1);
    const sent = (JSON.parse(posted[0] ?? "{}") as { events: FeedbackEvent[] }).events;
    assert.deepEqual(
      sent.map((e) => e.event_id),
      ids,
    );
    assert.deepEqual(sent[0], generation);
    assert.deepEqual(new Set(sent.map((e) => e.type)), new Set(EVENT_TYPES), "every event type is covered");

    const onTopic = await byEventId("main");
    for (const ev of sent) {
      const records = onTopic.get(ev.event_id);
      assert.equal(records?.length, 1, `${ev.type} ${ev.event_id} is on the topic ${records?.length ?? 0} times`);
      const record = records?.[0];
      assert.ok(record);
      assert.equal(record.key, ev.request_id, "records are keyed by request_id");
      assert.deepEqual(JSON.parse(record.value.toString("utf8")), ev, `${ev.type}: the fields differ`);
      assert.ok(
        record.value.equals(Buffer.from(JSON.stringify(ev), "utf8")),
        `${ev.type}: the record is not byte for byte what the client sent:\n` +
          `${record.value.toString("utf8")}\n${JSON.stringify(ev)}`,
      );
    }
  });

  test("a ts given in another spelling arrives as the same instant in the canonical form", async () => {
    const { client, errors } = clientFor(MAIN);
    clients.push(client);
    const id = client.accept({ requestId: "req-ts", sessionId: session("ts"), ts: "2026-11-21T11:00:00+01:00" });
    await client.flush();
    assert.deepEqual(errors, []);
    const record = (await byEventId("main")).get(id)?.[0];
    assert.ok(record);
    assert.equal(JSON.parse(record.value.toString("utf8")).ts, "2026-11-21T10:00:00.000000Z");
  });

  test("a 422 refuses only the invalid events, reported with the server's errors; the rest arrive", async () => {
    const { client, errors } = clientFor(MAIN);
    clients.push(client);
    const ref = { requestId: "req-422", sessionId: session("invalid") };
    const good = [client.accept(ref)];
    const badFraction = client.editPersistence({ ...ref, fraction: 1.5, afterS: 10 });
    good.push(client.reject(ref));
    const badValue = client.send({ ...generationEvent({ ...ref, modelVersion: "1", promptTokens: [], completionTokens: [1], logprobs: [0.5], temperature: 1 }) });
    good.push(client.followup({ ...ref, sentiment: -1 }));
    await client.flush();

    assert.equal(errors.length, 1, errors.map((e) => e.message).join("\n"));
    const [err] = errors;
    assert.ok(err);
    assert.equal(err.kind, "rejected");
    assert.equal(err.status, 422);
    assert.deepEqual(
      err.events.map((e) => e.event_id),
      [badFraction, badValue],
    );
    const details = err.details as Array<{ index: number; field: string; message: string }>;
    assert.deepEqual(
      details.map((d) => [d.index, d.field]),
      [
        [0, "fraction"],
        [1, "logprobs.0"],
      ],
    );
    assert.match(details[0]?.message ?? "", /less than or equal to 1/);
    const onTopic = await byEventId("main");
    for (const id of good) {
      assert.equal(onTopic.get(id)?.length, 1, `valid event ${id} did not arrive`);
    }
    assert.equal(onTopic.has(badFraction) || onTopic.has(badValue), false);
  });

  test("an oversized batch is split rather than retried; a single oversized event is refused, the rest arrive", async () => {
    let posts = 0;
    const { client, errors } = clientFor(SMALL, {
      batchSize: 200,
      fetch: (input, init) => {
        posts++;
        return fetch(input, init);
      },
    });
    clients.push(client);
    const ref = { requestId: "req-big", sessionId: session("oversized") };
    const small: string[] = [];
    for (let i = 0; i < 60; i++) {
      small.push(client.followup({ ...ref, sentiment: i / 100 }));
    }
    const big = client.toolError({ ...ref, message: "x".repeat(SMALL_MAX_EVENT_BYTES), tokenIndex: 0 });
    for (let i = 0; i < 60; i++) {
      small.push(client.accept(ref));
    }
    await client.flush();

    assert.equal(errors.length, 1, errors.map((e) => e.message).join("\n"));
    const [err] = errors;
    assert.ok(err);
    assert.equal(err.kind, "rejected");
    assert.equal(err.status, 413);
    assert.deepEqual(
      err.events.map((e) => e.event_id),
      [big],
    );
    assert.match(JSON.stringify(err.details), /max_event_bytes/);
    // 121 events of ~250 bytes in bodies of at most 4 KiB: split (more than one post), into a
    // few dozen posts by halving, not an endless retry
    assert.ok(posts > 2 && posts < 121, `${posts} posts for 121 events`);
    const onTopic = await byEventId("small");
    for (const id of small) {
      assert.equal(onTopic.get(id)?.length, 1, `event ${id} did not arrive exactly once`);
    }
    assert.equal(onTopic.has(big), false);
    assert.equal(client.pending, 0);
  });

  test("dispose flushes what is queued; events after it are reported dropped", async () => {
    const { client, errors } = clientFor(MAIN, { flushIntervalMs: 60_000 });
    const ref = { requestId: "req-dispose", sessionId: session("dispose") };
    const ids = [client.accept(ref), client.rating({ ...ref, value: 1 }), client.reject(ref)];
    assert.equal(client.pending, 3);
    await client.dispose();
    assert.equal(client.pending, 0);
    const late = client.accept(ref);
    assert.deepEqual(
      errors.map((e) => [e.kind, e.events.map((ev) => ev.event_id)]),
      [["dropped", [late]]],
    );
    const onTopic = await byEventId("main");
    for (const id of ids) {
      assert.equal(onTopic.get(id)?.length, 1, `queued event ${id} was not flushed by dispose`);
    }
    assert.equal(onTopic.has(late), false);
  });

  test("a broker outage mid-stream loses nothing once the broker is back", async (t) => {
    const { client, errors } = clientFor(MAIN, {
      batchSize: 20,
      flushIntervalMs: 200,
      maxRetries: 2,
      minBackoffMs: 100,
      maxBackoffMs: 1000,
    });
    clients.push(client);
    const ref = { requestId: "req-outage", sessionId: session("outage") };
    const sent: string[] = [];
    const emit = (i: number) =>
      sent.push(i % 2 ? client.accept({ ...ref, requestId: `req-${i}` }) : client.followup({ ...ref, sentiment: 0.5 }));
    for (let i = 0; i < 40; i++) {
      emit(i);
    }
    await client.flush();
    assert.equal(client.pending, 0);

    await control("POST", "/broker/stop");
    let stopped = true;
    try {
      for (let i = 40; i < 140; i++) {
        emit(i); // the editor keeps working while Kafka is down
        if (i % 10 === 0) {
          await sleep(100);
        }
      }
      await until("the client to report the outage", () => errors.some((e) => e.kind === "unavailable"));
      assert.ok(client.pending > 0, "events wait in the queue while Kafka is down");
      await control("POST", "/broker/start");
      stopped = false;
    } finally {
      if (stopped) {
        await control("POST", "/broker/start");
      }
    }
    const deadline = Date.now() + 180_000;
    while (client.pending > 0) {
      assert.ok(Date.now() < deadline, `${client.pending} events still pending 180 s after the broker came back`);
      await client.flush();
    }
    await client.dispose();

    const outage = errors.filter((e) => e.kind === "unavailable");
    assert.ok(outage.every((e) => e.willRetry && (e.status === 503 || e.status === undefined)), "only 503s and network errors");
    assert.deepEqual(
      errors.filter((e) => e.kind !== "unavailable"),
      [],
      "nothing was rejected or dropped",
    );
    const onTopic = await byEventId("main");
    const lost = sent.filter((id) => !onTopic.has(id));
    assert.deepEqual(lost, [], `${lost.length} of ${sent.length} events lost`);
    // A 503 promises nothing either way (docs/API.md): a batch may land and be re-sent, so an
    // event may be on the topic twice with the same event_id, which every consumer dedupes.
    const twice = sent.filter((id) => (onTopic.get(id)?.length ?? 0) > 1).length;
    for (const id of sent) {
      const values = new Set(onTopic.get(id)?.map((r) => r.value.toString("base64")));
      assert.equal(values.size, 1, `event ${id} arrived in different versions`);
    }
    t.diagnostic(`outage: ${sent.length} events, ${outage.length} unavailable reports, ${twice} on the topic twice`);
  });
});

// --- the OpenAPI document, as far as the drift check reads it ------------------------------------
interface JsonSchema {
  type?: string;
  const?: string | number;
  enum?: (string | number)[];
  anyOf?: JsonSchema[];
  items?: JsonSchema;
  prefixItems?: JsonSchema[];
  [key: string]: unknown;
}

interface OpenApi {
  paths: {
    [path: string]: {
      post?: {
        requestBody?: {
          content?: {
            [type: string]: {
              schema?: {
                properties?: {
                  events?: { items?: { discriminator?: { propertyName: string; mapping: Record<string, string> } } };
                };
              };
            };
          };
        };
      };
    };
  };
  components: {
    schemas: Record<string, { properties: Record<string, JsonSchema>; required: string[]; additionalProperties?: boolean }>;
  };
}

const KEPT = ["format", "pattern", "minimum", "maximum", "exclusiveMinimum", "minLength", "maxLength", "minItems", "maxItems"] as const;

/** The document's `components.schemas`, for the `$ref`s of nested objects (set per test). */
let COMPONENTS: { [name: string]: JsonSchema } = {};

/** A property of the API's schema in EVENT_SCHEMAS's shape: `X | null` is X (the client leaves such fields out), `const` is a one-value enum, a tuple of one item type is an array of it. */
function normalise(p: JsonSchema, where: string): FieldSchema {
  if (p.anyOf) {
    const nonNull = p.anyOf.filter((s) => s.type !== "null");
    assert.equal(nonNull.length, 1, `${where}: a union the client does not model`);
    return normalise(nonNull[0] as JsonSchema, where);
  }
  if (typeof p.$ref === "string") {
    const target = COMPONENTS[p.$ref.slice("#/components/schemas/".length)];
    assert.ok(target, `${where}: $ref ${p.$ref} is not in the document`);
    return normalise(target, where);
  }
  const out: Record<string, unknown> = { type: p.type };
  if (p.type === "object") {
    const props = (p.properties ?? {}) as { [name: string]: JsonSchema };
    assert.equal(p.additionalProperties, false, `${where}: unknown fields must be refused`);
    out.properties = Object.fromEntries(
      Object.entries(props).map(([name, s]) => [name, normalise(s, `${where}.${name}`)]),
    );
    out.required = p.required;
  }
  if (p.const !== undefined) {
    out.enum = [p.const];
  }
  if (p.enum !== undefined) {
    out.enum = p.enum;
  }
  for (const key of KEPT) {
    if (p[key] !== undefined) {
      out[key] = p[key];
    }
  }
  if (p.items) {
    out.items = normalise(p.items, `${where}[]`);
  }
  if (p.prefixItems) {
    const items = p.prefixItems.map((s, i) => normalise(s, `${where}[${i}]`));
    assert.ok(items.every((s) => JSON.stringify(s) === JSON.stringify(items[0])), `${where}: a mixed tuple`);
    out.items = items[0];
  }
  return out as unknown as FieldSchema;
}
