/**
 * Unit tests of the client's own logic, with an injected `fetch` standing in for the server:
 * the builders' wire shape, the TypeScript types against EVENT_SCHEMAS (at compile time),
 * backoff and Retry-After, retries re-sending the same event ids, the overflow policy,
 * dispose, and that nothing throws into the caller. The behaviour against the real API and
 * Kafka broker is in integration.test.ts.
 */

import assert from "node:assert/strict";
import { describe, test } from "node:test";

import {
  DeliveryError,
  EVENT_SCHEMAS,
  EVENT_TYPES,
  FeedbackClient,
  MAX_RETRY_AFTER_MS,
  acceptEvent,
  backoffDelayMs,
  editPersistenceEvent,
  followupEvent,
  sessionOutcomeEvent,
  generationEvent,
  ratingEvent,
  rejectEvent,
  retryAfterMs,
  toolErrorEvent,
  type AcceptEvent,
  type EditPersistenceEvent,
  type EventType,
  type FeedbackEvent,
  type FollowupEvent,
  type SessionOutcomeEvent,
  type GenerationEvent,
  type RatingEvent,
  type RejectEvent,
  type ToolErrorEvent,
} from "@flywheel/feedback-client";

// --- compile-time: the TypeScript types name exactly the fields EVENT_SCHEMAS describes --------
type Equal<A, B> = (<T>() => T extends A ? 1 : 2) extends <T>() => T extends B ? 1 : 2 ? true : false;
type RequiredKeys<T> = { [K in keyof T]-?: object extends Pick<T, K> ? never : K }[keyof T];
type Fields<T extends EventType> = keyof (typeof EVENT_SCHEMAS)[T]["fields"];
type Required_<T extends EventType> = (typeof EVENT_SCHEMAS)[T]["required"][number];
type Agrees<E, T extends EventType> = [Equal<keyof E, Fields<T>>, Equal<RequiredKeys<E>, Required_<T>>];
const typesAgree: {
  [T in EventType]: Agrees<Extract<FeedbackEvent, { type: T }>, T>;
} = {
  generation: [true, true] satisfies Agrees<GenerationEvent, "generation">,
  accept: [true, true] satisfies Agrees<AcceptEvent, "accept">,
  reject: [true, true] satisfies Agrees<RejectEvent, "reject">,
  edit_persistence: [true, true] satisfies Agrees<EditPersistenceEvent, "edit_persistence">,
  rating: [true, true] satisfies Agrees<RatingEvent, "rating">,
  tool_error: [true, true] satisfies Agrees<ToolErrorEvent, "tool_error">,
  followup: [true, true] satisfies Agrees<FollowupEvent, "followup">,
  session_outcome: [true, true] satisfies Agrees<SessionOutcomeEvent, "session_outcome">,
};

const REF = { requestId: "req-1", sessionId: "sess-1" };
const BASE = "http://feedback.invalid";

/** A fetch that answers from `answers` in turn (the last one repeats) and records every request. */
function scriptedFetch(answers: Array<() => Response | Promise<Response>>) {
  const calls: Array<{ at: number; body: string; headers: Headers }> = [];
  const fetchImpl: typeof fetch = async (_input, init) => {
    calls.push({ at: Date.now(), body: String(init?.body), headers: new Headers(init?.headers) });
    const answer = answers[Math.min(calls.length - 1, answers.length - 1)];
    assert.ok(answer, "scriptedFetch needs at least one answer");
    return answer();
  };
  return { fetchImpl, calls };
}

const accepted = () => new Response(JSON.stringify({ accepted: 1 }), { status: 202 });

function collect(): { errors: DeliveryError[]; onError: (e: DeliveryError) => void } {
  const errors: DeliveryError[] = [];
  return { errors, onError: (e) => errors.push(e) };
}

describe("builders", () => {
  test("every event type has a builder producing its wire shape, with a fresh id and a canonical ts", () => {
    const built: FeedbackEvent[] = [
      generationEvent({
        ...REF,
        modelVersion: "3",
        promptTokens: [1, 2],
        completionTokens: [3],
        logprobs: [-0.5],
        temperature: 1,
        finishReason: "cancelled",
        stream: true,
      }),
      acceptEvent(REF),
      rejectEvent(REF),
      editPersistenceEvent({ ...REF, fraction: 0.5, afterS: 30 }),
      ratingEvent({ ...REF, value: -1 }),
      toolErrorEvent({ ...REF, message: "boom", tokenIndex: 0 }),
      followupEvent({ ...REF, sentiment: 0.25 }),
      sessionOutcomeEvent({ ...REF, outcome: "success" }),
    ];
    assert.deepEqual(built.map((e) => e.type).sort(), [...EVENT_TYPES].sort());
    assert.equal(Object.keys(typesAgree).length, EVENT_TYPES.length);
    assert.equal(new Set(built.map((e) => e.event_id)).size, built.length);
    for (const ev of built) {
      assert.match(ev.event_id, /^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/);
      assert.match(ev.ts, /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$/);
      const schema = EVENT_SCHEMAS[ev.type];
      for (const key of Object.keys(ev)) {
        assert.ok(key in schema.fields, `${ev.type} has field ${key} that its schema does not`);
      }
      for (const key of schema.required) {
        assert.ok(key in ev, `${ev.type} lacks required field ${key}`);
      }
    }
    const tool = built[5] as ToolErrorEvent;
    assert.equal("hint" in tool, false, "an undefined optional field is left out, not sent as null");
    assert.equal((built[0] as GenerationEvent).tokenizer, "byte-v1");
  });

  test("a ref's eventId, ts and modelVersion are kept", () => {
    const ev = acceptEvent({ ...REF, eventId: "e-1", ts: "2026-11-21T10:00:00Z", modelVersion: "7" });
    assert.deepEqual(ev, {
      event_id: "e-1",
      request_id: "req-1",
      session_id: "sess-1",
      ts: "2026-11-21T10:00:00Z",
      model_version: "7",
      type: "accept",
    });
  });
});

describe("backoff and Retry-After", () => {
  const limits = { minBackoffMs: 100, maxBackoffMs: 1000 };

  test("the backoff doubles per attempt, is jittered within [b/2, b], and is capped", () => {
    assert.equal(backoffDelayMs(0, limits, 0), 50);
    assert.equal(backoffDelayMs(0, limits, 0.999999) > 99.99, true);
    assert.equal(backoffDelayMs(3, limits, 0), 400);
    assert.equal(backoffDelayMs(3, limits, 0.5), 600);
    assert.equal(backoffDelayMs(20, limits, 0), 500);
    assert.equal(backoffDelayMs(20, limits, 0.999999) <= 1000, true);
    const draws = new Set(Array.from({ length: 20 }, () => backoffDelayMs(2, limits, Math.random())));
    assert.ok(draws.size > 1, "two clients retrying together should not wait the same time");
  });

  test("a longer Retry-After wins over the backoff, a shorter one does not", () => {
    assert.equal(backoffDelayMs(0, limits, 0, 2000), 2000);
    assert.equal(backoffDelayMs(3, limits, 0, 10), 400);
  });

  test("Retry-After is read as seconds or an HTTP date, capped, and ignored when unreadable", () => {
    assert.equal(retryAfterMs("2"), 2000);
    assert.equal(retryAfterMs("0.5"), 500);
    assert.equal(retryAfterMs("86400"), MAX_RETRY_AFTER_MS);
    const now = Date.parse("2026-11-24T10:00:00Z");
    assert.equal(retryAfterMs("Tue, 24 Nov 2026 10:00:03 GMT", now), 3000);
    assert.equal(retryAfterMs("Tue, 24 Nov 2026 09:00:00 GMT", now), 0);
    assert.equal(retryAfterMs("soon"), undefined);
    assert.equal(retryAfterMs(null), undefined);
  });
});

describe("FeedbackClient with a scripted server", () => {
  test("a 429 with Retry-After is retried with the same body after at least that long", async () => {
    const { fetchImpl, calls } = scriptedFetch([
      () => new Response("slow down", { status: 429, headers: { "Retry-After": "1" } }),
      accepted,
    ]);
    const { errors, onError } = collect();
    const client = new FeedbackClient({
      baseUrl: BASE,
      apiKey: "k",
      flushIntervalMs: 0,
      minBackoffMs: 10,
      maxBackoffMs: 20,
      fetch: fetchImpl,
      onError,
    });
    const id = client.rating({ ...REF, value: 1 });
    await client.flush();
    assert.equal(calls.length, 2);
    const [first, second] = calls;
    assert.ok(first && second);
    assert.equal(second.body, first.body, "a retry re-sends the same events with the same ids");
    assert.equal(JSON.parse(first.body).events[0].event_id, id);
    assert.equal(first.headers.get("authorization"), "Bearer k");
    // setTimeout may fire up to a millisecond early; the backoff alone would be <= 20 ms
    assert.ok(second.at - first.at >= 990, `retried after ${second.at - first.at} ms, Retry-After said 1 s`);
    assert.deepEqual(errors, []);
    assert.equal(client.pending, 0);
    await client.dispose();
  });

  test("503s and network errors are retried maxRetries times, then reported and kept queued", async () => {
    let failures = 0;
    const { fetchImpl, calls } = scriptedFetch([
      () => new Response(JSON.stringify({ detail: "kafka down" }), { status: 503 }),
      () => {
        failures++;
        throw new TypeError("fetch failed");
      },
    ]);
    const { errors, onError } = collect();
    const client = new FeedbackClient({
      baseUrl: BASE,
      apiKey: "k",
      flushIntervalMs: 0,
      maxRetries: 2,
      minBackoffMs: 1,
      maxBackoffMs: 2,
      fetch: fetchImpl,
      onError,
    });
    const ids = [client.accept(REF), client.reject(REF)];
    await client.flush();
    assert.equal(calls.length, 3, "one try and two retries");
    assert.equal(failures, 2);
    assert.equal(new Set(calls.map((c) => c.body)).size, 1, "every attempt sent the same body");
    assert.equal(errors.length, 1);
    const [err] = errors;
    assert.ok(err);
    assert.equal(err.kind, "unavailable");
    assert.equal(err.willRetry, true);
    assert.deepEqual(
      err.events.map((e) => e.event_id),
      ids,
    );
    assert.match(err.message, /fetch failed/);
    assert.equal(client.pending, 2, "the events stay queued for the next flush");
  });

  test("unavailable events are re-sent with the same ids on the next flush", async () => {
    const { fetchImpl, calls } = scriptedFetch([
      () => new Response("", { status: 502 }),
      accepted,
    ]);
    const { errors, onError } = collect();
    const client = new FeedbackClient({
      baseUrl: BASE,
      apiKey: "k",
      flushIntervalMs: 0,
      maxRetries: 0,
      fetch: fetchImpl,
      onError,
    });
    client.accept(REF);
    await client.flush();
    assert.equal(client.pending, 1);
    await client.flush();
    assert.equal(client.pending, 0);
    assert.equal(calls[1]?.body, calls[0]?.body);
    assert.deepEqual(
      errors.map((e) => e.kind),
      ["unavailable"],
    );
  });

  test('overflow "drop-oldest" discards the oldest queued event and reports it', () => {
    const { errors, onError } = collect();
    const client = new FeedbackClient({
      baseUrl: BASE,
      apiKey: "k",
      flushIntervalMs: 0,
      batchSize: 10,
      maxQueue: 3,
      fetch: scriptedFetch([accepted]).fetchImpl,
      onError,
    });
    const ids = [1, 2, 3, 4, 5].map((i) => client.accept({ ...REF, eventId: `e${i}` }));
    assert.deepEqual(ids, ["e1", "e2", "e3", "e4", "e5"]);
    assert.equal(client.pending, 3);
    assert.deepEqual(
      errors.map((e) => [e.kind, e.events.map((ev) => ev.event_id)]),
      [
        ["dropped", ["e1"]],
        ["dropped", ["e2"]],
      ],
    );
  });

  test('overflow "drop-newest" refuses the new event and keeps the queue', async () => {
    const { errors, onError } = collect();
    const { fetchImpl, calls } = scriptedFetch([accepted]);
    const client = new FeedbackClient({
      baseUrl: BASE,
      apiKey: "k",
      flushIntervalMs: 0,
      batchSize: 10,
      maxQueue: 2,
      overflow: "drop-newest",
      fetch: fetchImpl,
      onError,
    });
    for (const i of [1, 2, 3]) {
      client.accept({ ...REF, eventId: `e${i}` });
    }
    assert.deepEqual(
      errors.map((e) => [e.kind, e.events.map((ev) => ev.event_id)]),
      [["dropped", ["e3"]]],
    );
    await client.flush();
    assert.deepEqual(
      JSON.parse(calls[0]?.body ?? "{}").events.map((e: FeedbackEvent) => e.event_id),
      ["e1", "e2"],
    );
  });

  test("a full batch is posted without waiting for the timer", async () => {
    const { fetchImpl, calls } = scriptedFetch([accepted]);
    const client = new FeedbackClient({
      baseUrl: BASE,
      apiKey: "k",
      flushIntervalMs: 0,
      batchSize: 2,
      fetch: fetchImpl,
    });
    client.accept(REF);
    assert.equal(calls.length, 0);
    client.accept(REF);
    await client.flush();
    assert.equal(calls.length, 1);
    assert.equal(JSON.parse(calls[0]?.body ?? "{}").events.length, 2);
  });

  test("a 413 for the whole body halves the batch down to single events; a lone one is refused", async () => {
    // a stand-in for the server's body limit: more than 2 events is too large, and e3 alone is too
    const posted: string[][] = [];
    const fetchImpl: typeof fetch = async (_input, init) => {
      const ids = (JSON.parse(String(init?.body)) as { events: FeedbackEvent[] }).events.map((e) => e.event_id);
      posted.push(ids);
      if (ids.length > 2 || ids.includes("e3")) {
        return new Response(JSON.stringify({ detail: "request body exceeds 4096 bytes" }), { status: 413 });
      }
      return new Response(JSON.stringify({ accepted: ids.length }), { status: 202 });
    };
    const { errors, onError } = collect();
    const client = new FeedbackClient({ baseUrl: BASE, apiKey: "k", flushIntervalMs: 0, fetch: fetchImpl, onError });
    for (const i of [1, 2, 3, 4, 5, 6]) {
      client.accept({ ...REF, eventId: `e${i}` });
    }
    await client.flush();
    assert.deepEqual(posted, [
      ["e1", "e2", "e3", "e4", "e5", "e6"],
      ["e1", "e2", "e3"],
      ["e1"],
      ["e2", "e3"],
      ["e2"],
      ["e3"],
      ["e4", "e5", "e6"],
      ["e4"],
      ["e5", "e6"],
    ]);
    assert.deepEqual(
      errors.map((e) => [e.kind, e.status, e.events.map((ev) => ev.event_id)]),
      [["rejected", 413, ["e3"]]],
    );
    assert.equal(client.pending, 0);
  });

  test("a 413 or 422 naming events refuses those and re-posts the rest; one about the body refuses the batch", async () => {
    const posted: string[][] = [];
    const fetchImpl: typeof fetch = async (_input, init) => {
      const ids = (JSON.parse(String(init?.body)) as { events: FeedbackEvent[] }).events.map((e) => e.event_id);
      posted.push(ids);
      const errors = ids.flatMap((id, index) =>
        id === "big" ? [{ index, field: "(event)", message: "too large" }] : id === "bad" ? [{ index, field: "value", message: "must be 1 or -1" }] : [],
      );
      if (ids.includes("big")) {
        return new Response(JSON.stringify({ errors: errors.filter((e) => e.field === "(event)") }), { status: 413 });
      }
      if (ids.includes("bad")) {
        return new Response(JSON.stringify({ errors }), { status: 422 });
      }
      if (ids.includes("body")) {
        return new Response(JSON.stringify({ errors: [{ index: null, field: "events", message: "no" }] }), { status: 422 });
      }
      return new Response(JSON.stringify({ accepted: ids.length }), { status: 202 });
    };
    const { errors, onError } = collect();
    const client = new FeedbackClient({ baseUrl: BASE, apiKey: "k", flushIntervalMs: 0, fetch: fetchImpl, onError });
    for (const id of ["a", "big", "b", "bad", "c"]) {
      client.accept({ ...REF, eventId: id });
    }
    await client.flush();
    assert.deepEqual(posted, [
      ["a", "big", "b", "bad", "c"],
      ["a", "b", "bad", "c"],
      ["a", "b", "c"],
    ]);
    assert.deepEqual(
      errors.map((e) => [e.status, e.events.map((ev) => ev.event_id), e.details]),
      [
        [413, ["big"], [{ index: 0, field: "(event)", message: "too large" }]],
        [422, ["bad"], [{ index: 0, field: "value", message: "must be 1 or -1" }]],
      ],
    );
    client.accept({ ...REF, eventId: "body" });
    client.accept({ ...REF, eventId: "d" });
    await client.flush();
    assert.deepEqual(posted.at(-1), ["body", "d"]);
    assert.deepEqual(
      errors.at(-1)?.events.map((ev) => ev.event_id),
      ["body", "d"],
      "an error about the whole body refuses the whole batch",
    );
    assert.equal(posted.length, 4);
  });

  test("dispose flushes what is queued; later events are reported dropped, never thrown", async () => {
    const { fetchImpl, calls } = scriptedFetch([accepted]);
    const { errors, onError } = collect();
    const client = new FeedbackClient({ baseUrl: BASE, apiKey: "k", flushIntervalMs: 60_000, fetch: fetchImpl, onError });
    const ids = [client.accept(REF), client.followup({ ...REF, sentiment: 1 })];
    await client.dispose();
    assert.equal(calls.length, 1);
    assert.deepEqual(
      JSON.parse(calls[0]?.body ?? "{}").events.map((e: FeedbackEvent) => e.event_id),
      ids,
    );
    const late = client.reject(REF);
    assert.equal(typeof late, "string");
    assert.deepEqual(
      errors.map((e) => [e.kind, e.events[0]?.event_id]),
      [["dropped", late]],
    );
    await client.dispose(); // a second dispose is harmless
    assert.equal(calls.length, 1);
  });

  test("dispose reports events it could not deliver as unavailable and not retried", async () => {
    const { errors, onError } = collect();
    const client = new FeedbackClient({
      baseUrl: BASE,
      apiKey: "k",
      flushIntervalMs: 0,
      batchSize: 1,
      maxRetries: 1,
      minBackoffMs: 1,
      maxBackoffMs: 1,
      fetch: scriptedFetch([() => new Response("", { status: 503 })]).fetchImpl,
      onError,
    });
    const ids = [client.accept(REF), client.accept(REF), client.accept(REF)];
    await client.dispose();
    assert.equal(client.pending, 0);
    const finalErrors = errors.filter((e) => !e.willRetry);
    assert.deepEqual(
      finalErrors.flatMap((e) => e.events.map((ev) => ev.event_id)).sort(),
      [...ids].sort(),
      "every event is reported exactly once as given up",
    );
    assert.ok(finalErrors.every((e) => e.kind === "unavailable"));
  });

  test("an onError that throws reaches neither the caller nor delivery", async () => {
    const { fetchImpl, calls } = scriptedFetch([accepted]);
    const client = new FeedbackClient({
      baseUrl: BASE,
      apiKey: "k",
      flushIntervalMs: 0,
      maxQueue: 1,
      fetch: fetchImpl,
      onError: () => {
        throw new Error("bug in the editor's hook");
      },
    });
    client.accept(REF);
    assert.doesNotThrow(() => client.accept(REF)); // overflow -> onError throws -> swallowed
    await client.flush();
    assert.equal(calls.length, 1);
  });

  test("NaN and Infinity are refused at once, naming the field, and never sent", async () => {
    const { fetchImpl, calls } = scriptedFetch([accepted]);
    const { errors, onError } = collect();
    const client = new FeedbackClient({ baseUrl: BASE, apiKey: "k", flushIntervalMs: 0, fetch: fetchImpl, onError });
    client.followup({ ...REF, sentiment: Number.NaN });
    await client.flush();
    assert.equal(calls.length, 0);
    assert.equal(errors[0]?.kind, "rejected");
    assert.deepEqual(errors[0]?.details, [
      { index: 0, field: "sentiment", message: "sentiment is not a finite number (NaN and Infinity are not JSON)" },
    ]);
  });

  test("bad options are a RangeError at construction that names each", () => {
    assert.throws(
      () => new FeedbackClient({ baseUrl: "ftp://x", apiKey: "", batchSize: 5000, maxQueue: 0 }),
      (err: unknown) =>
        err instanceof RangeError &&
        /batchSize/.test(err.message) &&
        /maxQueue/.test(err.message) &&
        /baseUrl/.test(err.message) &&
        /apiKey/.test(err.message),
    );
  });
});
