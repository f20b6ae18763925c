/**
 * FeedbackClient: batches feedback events and posts them to `POST {baseUrl}/v1/events`.
 *
 * The contract (the README says it for users):
 *
 * - Methods that queue an event (`accept`, `rating`, ..., `send`) return its `event_id` at once
 *   and never throw for a delivery problem: every failure is reported to `onError` as a
 *   `DeliveryError` naming the events concerned. `flush()` and `dispose()` always resolve.
 * - Events wait in a bounded in-memory queue (`maxQueue`). When it is full, `overflow` decides:
 *   "drop-oldest" (default) discards the oldest queued event, "drop-newest" refuses the new
 *   one; either way the discarded event is reported (`kind: "dropped"`). Events in the batch
 *   being posted (at most `batchSize`) are not counted in the queue.
 * - A batch is posted when `batchSize` events are queued, every `flushIntervalMs`, on `flush()`
 *   and on `dispose()`. One batch is in flight at a time, in queue order.
 * - 429, 500, 502, 503, 504 and network errors (including `timeoutMs`) are retried up to
 *   `maxRetries` times with the SAME body, so the SAME event ids: the pipeline dedupes by
 *   event_id, which makes a retry safe. The wait before retry n (0-based) is drawn uniformly
 *   from [b/2, b] with b = min(maxBackoffMs, minBackoffMs * 2^n) ("equal jitter"), or the
 *   server's Retry-After (seconds or an HTTP date, capped at 60 s) when that is longer.
 * - When the retries run out, the batch is reported (`kind: "unavailable"`, `willRetry: true`)
 *   and put back at the head of the queue for the next flush; during `dispose()` it is
 *   reported with `willRetry: false` and discarded.
 * - The server takes a batch all-or-nothing. A 413 or 422 whose errors all name events (over
 *   the per-event size limit, invalid) refuses those events and posts the rest again; a 413
 *   for the whole body halves the batch and posts each half, down to a single event, which is
 *   then refused. Any other answer (422 about the body, 401, 403, 415) refuses the batch. Refusals are `kind: "rejected"` with the HTTP status and the
 *   server's `errors` (`[{index, field, message}]`, `index` into the error's `events`).
 */

import {
  acceptEvent,
  editPersistenceEvent,
  followupEvent,
  sessionOutcomeEvent,
  type SessionOutcomeEvent,
  ratingEvent,
  rejectEvent,
  toolErrorEvent,
  type FeedbackEvent,
  type SessionRef,
} from "./events.js";
import { DeliveryError, type ServerError } from "./errors.js";
import { RETRY_STATUSES, backoffDelayMs, retryAfterMs } from "./retry.js";

export interface FeedbackClientOptions {
  /** The ingest API, e.g. "http://127.0.0.1:8000" (events go to POST {baseUrl}/v1/events). */
  baseUrl: string;
  /** An ingest key, sent as `Authorization: Bearer <key>`. */
  apiKey: string;
  /** Events per POST, 1..1000 (the server's limit). Default 100. */
  batchSize?: number;
  /** Background flush period; 0 = only size-triggered and explicit flushes. Default 1000. */
  flushIntervalMs?: number;
  /** Most events waiting in the queue. Default 10000. */
  maxQueue?: number;
  /** What happens to an event that does not fit in the queue. Default "drop-oldest". */
  overflow?: "drop-oldest" | "drop-newest";
  /** Retries of one batch on 429/5xx/network errors before it is reported unavailable. Default 8. */
  maxRetries?: number;
  /** Backoff before the first retry (upper bound of its jitter range). Default 250. */
  minBackoffMs?: number;
  /** Largest backoff between retries. Default 10000. */
  maxBackoffMs?: number;
  /** Time limit of one POST (then it counts as a network error). Default 30000. */
  timeoutMs?: number;
  /** Where delivery failures go. Default: `console.error`. Errors thrown by it are ignored. */
  onError?: (error: DeliveryError) => void;
  /** The fetch to use. Default: globalThis.fetch. */
  fetch?: typeof fetch;
}

type Settings = Required<Omit<FeedbackClientOptions, "onError" | "fetch">>;

const DEFAULTS = {
  batchSize: 100,
  flushIntervalMs: 1000,
  maxQueue: 10_000,
  overflow: "drop-oldest",
  maxRetries: 8,
  minBackoffMs: 250,
  maxBackoffMs: 10_000,
  timeoutMs: 30_000,
} as const;

/** The outcome of one POST after its retries. */
type Answer =
  | { ok: true; status: number; body: unknown }
  | { ok: false; retryable: false; status: number; body: unknown }
  | { ok: false; retryable: true; status?: number; body: unknown; message: string };

export class FeedbackClient {
  private readonly settings: Settings;
  private readonly url: string;
  private readonly onError: (error: DeliveryError) => void;
  private readonly fetchImpl: typeof fetch;
  private readonly queue: FeedbackEvent[] = [];
  private inFlight = 0;
  private disposed = false;
  private finalFlush = false;
  private timer: ReturnType<typeof setTimeout> | undefined;
  private tail: Promise<void> = Promise.resolve(); // the last flush scheduled
  private next: Promise<void> | undefined; // a scheduled flush that has not started yet

  constructor(options: FeedbackClientOptions) {
    const s: Settings = {
      baseUrl: options.baseUrl,
      apiKey: options.apiKey,
      batchSize: options.batchSize ?? DEFAULTS.batchSize,
      flushIntervalMs: options.flushIntervalMs ?? DEFAULTS.flushIntervalMs,
      maxQueue: options.maxQueue ?? DEFAULTS.maxQueue,
      overflow: options.overflow ?? DEFAULTS.overflow,
      maxRetries: options.maxRetries ?? DEFAULTS.maxRetries,
      minBackoffMs: options.minBackoffMs ?? DEFAULTS.minBackoffMs,
      maxBackoffMs: options.maxBackoffMs ?? DEFAULTS.maxBackoffMs,
      timeoutMs: options.timeoutMs ?? DEFAULTS.timeoutMs,
    };
    checkOptions(s);
    this.settings = s;
    this.url = `${s.baseUrl.replace(/\/+$/, "")}/v1/events`;
    this.onError = options.onError ?? ((e) => console.error(`[feedback-client] ${e.message}`));
    const f = options.fetch ?? globalThis.fetch;
    if (typeof f !== "function") {
      throw new TypeError("no fetch available: pass options.fetch (Node >= 20 and browsers have one)");
    }
    this.fetchImpl = f;
    this.arm();
  }

  // --- events ---------------------------------------------------------------------------------
  accept(ref: SessionRef): string {
    return this.send(acceptEvent(ref));
  }

  reject(ref: SessionRef): string {
    return this.send(rejectEvent(ref));
  }

  editPersistence(ref: SessionRef & { fraction: number; afterS: number }): string {
    return this.send(editPersistenceEvent(ref));
  }

  rating(ref: SessionRef & { value: 1 | -1 }): string {
    return this.send(ratingEvent(ref));
  }

  toolError(ref: SessionRef & { message: string; hint?: string; tokenIndex: number }): string {
    return this.send(toolErrorEvent(ref));
  }

  followup(ref: SessionRef & { sentiment: number }): string {
    return this.send(followupEvent(ref));
  }

  /** How agent session `ref.sessionId` ended; `ref.requestId` is its last generation. */
  sessionOutcome(ref: SessionRef & { outcome: SessionOutcomeEvent["outcome"] }): string {
    return this.send(sessionOutcomeEvent(ref));
  }

  /** Queue an already-built event (see the builders); returns its event_id. Never throws. */
  send(event: FeedbackEvent): string {
    const id = event.event_id;
    if (this.disposed) {
      this.report(new DeliveryError("dropped", [event], "the client was disposed; event not sent"));
      return id;
    }
    const bad = nonFinite(event);
    if (bad !== undefined) {
      const message = `${bad} is not a finite number (NaN and Infinity are not JSON)`;
      this.report(
        new DeliveryError("rejected", [event], `event ${id} refused before sending: ${message}`, {
          details: [{ index: 0, field: bad, message }],
        }),
      );
      return id;
    }
    if (this.queue.length >= this.settings.maxQueue) {
      if (this.settings.overflow === "drop-newest") {
        this.report(overflowError([event], this.settings));
        return id;
      }
      this.report(overflowError(this.queue.splice(0, 1), this.settings));
    }
    this.queue.push(event);
    if (this.queue.length >= this.settings.batchSize) {
      void this.flush();
    }
    return id;
  }

  /** Events queued or being posted, not yet delivered nor reported as failed. */
  get pending(): number {
    return this.queue.length + this.inFlight;
  }

  /**
   * Post every event queued so far. Resolves (never rejects) once each was delivered or
   * reported to `onError`; events reported `unavailable` with `willRetry` stay queued.
   */
  flush(): Promise<void> {
    if (this.next !== undefined) {
      return this.next; // one not yet started covers every event queued before it starts
    }
    const run: Promise<void> = this.tail.then(() => {
      if (this.next === run) {
        this.next = undefined;
      }
      return this.drain();
    });
    this.next = run;
    this.tail = run;
    return run;
  }

  /**
   * Flush, then stop: the timer is cleared, events still undeliverable after the final flush's
   * retries are reported (`unavailable`, `willRetry: false`), and later events are reported
   * `dropped`. Resolves (never rejects); calling it again waits for the same final flush.
   */
  async dispose(): Promise<void> {
    if (!this.disposed) {
      this.disposed = true;
      if (this.timer !== undefined) {
        clearTimeout(this.timer);
        this.timer = undefined;
      }
      this.tail = this.tail.then(() => {
        this.finalFlush = true;
      });
      this.next = undefined;
    }
    await this.flush();
  }

  // --- delivery ---------------------------------------------------------------------------------
  /** Background flushes: a timer re-armed after each flush (unref'd on Node, so it keeps no process alive). */
  private arm(): void {
    if (this.settings.flushIntervalMs <= 0 || this.disposed) {
      return;
    }
    const timer = setTimeout(() => {
      void this.flush().then(() => this.arm());
    }, this.settings.flushIntervalMs);
    if (typeof timer === "object" && timer !== null && "unref" in timer) {
      timer.unref();
    }
    this.timer = timer;
  }

  /** Post the events queued when it starts, batch by batch. Never rejects. */
  private async drain(): Promise<void> {
    let budget = this.queue.length;
    while (budget > 0 && this.queue.length > 0) {
      const batch = this.queue.splice(0, Math.min(budget, this.settings.batchSize));
      budget -= batch.length;
      this.inFlight = batch.length;
      let unsent: FeedbackEvent[] = [];
      try {
        unsent = await this.postSplitting(batch);
      } catch (err) {
        // a bug, not a delivery answer: report the batch rather than lose it silently
        this.report(
          new DeliveryError("unavailable", batch, `internal error while posting: ${String(err)}`, {
            details: String(err),
            willRetry: false,
          }),
        );
      } finally {
        this.inFlight = 0;
      }
      if (unsent.length > 0) {
        if (!this.finalFlush) {
          this.queue.unshift(...unsent); // same order, same event ids, for the next flush
          this.trimOverflow();
        } else if (this.queue.length > 0) {
          const rest = this.queue.splice(0);
          this.report(
            new DeliveryError(
              "unavailable",
              rest,
              `${rest.length} events not sent: the server is unavailable and the client is disposed`,
              { willRetry: false },
            ),
          );
        }
        return; // the server is unavailable: later batches would fail the same way
      }
    }
  }

  private trimOverflow(): void {
    const over = this.queue.length - this.settings.maxQueue;
    if (over <= 0) {
      return;
    }
    const dropped =
      this.settings.overflow === "drop-oldest"
        ? this.queue.splice(0, over)
        : this.queue.splice(this.queue.length - over, over);
    this.report(overflowError(dropped, this.settings));
  }

  /** Post `batch`, splitting it on 413; returns the events left unsent because the server stayed unavailable. */
  private async postSplitting(batch: FeedbackEvent[]): Promise<FeedbackEvent[]> {
    const todo: FeedbackEvent[][] = [batch];
    for (let part = todo.shift(); part !== undefined; part = todo.shift()) {
      const answer = await this.postWithRetries(part);
      if (answer.ok) {
        continue;
      }
      if (answer.retryable) {
        const unsent = [part, ...todo].flat();
        this.report(
          new DeliveryError(
            "unavailable",
            unsent,
            `${unsent.length} events not delivered after ${this.settings.maxRetries} retries (${answer.message})` +
              (this.finalFlush ? "; the client is disposed, they are discarded" : "; kept queued for the next flush"),
            { status: answer.status, details: answer.body, willRetry: !this.finalFlush },
          ),
        );
        return unsent;
      }
      const errors = serverErrors(answer.body);
      const named = [...new Set(errors.map((e) => e.index))]
        .filter((i): i is number => Number.isInteger(i) && i !== null && i >= 0 && i < part.length)
        .sort((a, b) => a - b);
      const perEvent = named.length > 0 && errors.every((e) => e.index !== null);
      if ((answer.status === 413 || answer.status === 422) && perEvent) {
        // the server named the events it refuses (over the per-event size limit, or invalid)
        // and refused the batch for them alone: refuse those, post the rest
        this.reportRejected(
          answer.status,
          named.map((i) => part[i]!),
          errors.filter((e) => e.index !== null && named.includes(e.index)).map((e) => ({
            ...e,
            index: named.indexOf(e.index!),
          })),
        );
        const rest = part.filter((_, i) => !named.includes(i));
        if (rest.length > 0) {
          todo.unshift(rest);
        }
      } else if (answer.status === 413 && part.length > 1) {
        // the body is over the server's limit: halve it
        const half = Math.floor(part.length / 2);
        todo.unshift(part.slice(0, half), part.slice(half));
      } else {
        this.reportRejected(answer.status, part, errors);
      }
    }
    return [];
  }

  private async postWithRetries(batch: FeedbackEvent[]): Promise<Answer> {
    const body = JSON.stringify({ events: batch }); // one body for every attempt: same event ids
    for (let attempt = 0; ; attempt++) {
      const answer = await this.postOnce(body);
      if (!(answer.ok === false && answer.retryable) || attempt >= this.settings.maxRetries) {
        return answer;
      }
      const waitMs = backoffDelayMs(attempt, this.settings, Math.random(), answer.retryAfterMs);
      await sleep(waitMs);
    }
  }

  private async postOnce(body: string): Promise<Answer & { retryAfterMs?: number }> {
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), this.settings.timeoutMs);
    try {
      const resp = await this.fetchImpl(this.url, {
        method: "POST",
        headers: {
          Authorization: `Bearer ${this.settings.apiKey}`,
          "Content-Type": "application/json",
        },
        body,
        signal: abort.signal,
      });
      const text = await resp.text();
      const parsed = parseJson(text);
      if (resp.status === 202 || (resp.status >= 200 && resp.status < 300)) {
        return { ok: true, status: resp.status, body: parsed };
      }
      if (RETRY_STATUSES.has(resp.status)) {
        const retryAfter = retryAfterMs(resp.headers.get("retry-after"));
        return {
          ok: false,
          retryable: true,
          status: resp.status,
          body: parsed,
          message: `HTTP ${resp.status}: ${text.slice(0, 300)}`,
          ...(retryAfter === undefined ? {} : { retryAfterMs: retryAfter }),
        };
      }
      return { ok: false, retryable: false, status: resp.status, body: parsed };
    } catch (err) {
      const message = abort.signal.aborted
        ? `no answer within ${this.settings.timeoutMs} ms`
        : `network error: ${describe(err)}`;
      return { ok: false, retryable: true, body: message, message };
    } finally {
      clearTimeout(timer);
    }
  }

  private reportRejected(status: number, events: FeedbackEvent[], errors: ServerError[]): void {
    const lines = errors
      .slice(0, 10)
      .map((e) => `[${e.index}] ${e.field}: ${e.message}`)
      .join("; ");
    const more = errors.length > 10 ? ` (+${errors.length - 10} more)` : "";
    this.report(
      new DeliveryError(
        "rejected",
        events,
        `server rejected ${events.length} events with HTTP ${status}: ${lines}${more}`,
        { status, details: errors },
      ),
    );
  }

  private report(error: DeliveryError): void {
    try {
      this.onError(error);
    } catch {
      // the hook's own failure must not reach the caller (or stop delivery)
    }
  }
}

function checkOptions(s: Settings): void {
  const problems: string[] = [];
  const int = (name: keyof Settings, min: number, max = Number.MAX_SAFE_INTEGER) => {
    const v = s[name];
    if (typeof v !== "number" || !Number.isInteger(v) || v < min || v > max) {
      problems.push(`${name} must be an integer in ${min}..${max === Number.MAX_SAFE_INTEGER ? "" : max}, got ${String(v)}`);
    }
  };
  int("batchSize", 1, 1000);
  int("flushIntervalMs", 0);
  int("maxQueue", 1);
  int("maxRetries", 0);
  int("minBackoffMs", 0);
  int("maxBackoffMs", 0);
  int("timeoutMs", 1);
  if (s.maxBackoffMs < s.minBackoffMs) {
    problems.push(`maxBackoffMs (${s.maxBackoffMs}) must be >= minBackoffMs (${s.minBackoffMs})`);
  }
  if (s.overflow !== "drop-oldest" && s.overflow !== "drop-newest") {
    problems.push(`overflow must be "drop-oldest" or "drop-newest", got ${JSON.stringify(s.overflow)}`);
  }
  if (typeof s.baseUrl !== "string" || !/^https?:\/\//.test(s.baseUrl)) {
    problems.push(`baseUrl must be an http(s) URL, got ${JSON.stringify(s.baseUrl)}`);
  }
  if (typeof s.apiKey !== "string" || s.apiKey.length === 0) {
    problems.push("apiKey must be a non-empty string (an ingest key)");
  }
  if (problems.length > 0) {
    throw new RangeError(`invalid FeedbackClient options: ${problems.join("; ")}`);
  }
}

function overflowError(events: FeedbackEvent[], s: Settings): DeliveryError {
  return new DeliveryError(
    "dropped",
    events,
    `queue full (maxQueue ${s.maxQueue}, overflow "${s.overflow}"): ${events.length} event(s) dropped`,
  );
}

/** The dotted path of the first NaN/Infinity in an event, if any. */
function nonFinite(value: unknown, path = ""): string | undefined {
  if (typeof value === "number") {
    return Number.isFinite(value) ? undefined : path || "(event)";
  }
  if (typeof value === "object" && value !== null) {
    for (const [k, v] of Object.entries(value)) {
      const found = nonFinite(v, path ? `${path}.${k}` : k);
      if (found !== undefined) {
        return found;
      }
    }
  }
  return undefined;
}

/** The server's `errors`, or one entry built from its `detail` (or text) for other answers. */
function serverErrors(body: unknown): ServerError[] {
  if (typeof body === "object" && body !== null && Array.isArray((body as { errors?: unknown }).errors)) {
    return (body as { errors: ServerError[] }).errors;
  }
  const detail = typeof body === "object" && body !== null && "detail" in body ? body.detail : body;
  return [
    {
      index: null,
      field: "(request)",
      message: typeof detail === "string" ? detail : JSON.stringify(detail),
    },
  ];
}

function parseJson(text: string): unknown {
  try {
    return JSON.parse(text);
  } catch {
    return text;
  }
}

function describe(err: unknown): string {
  if (err instanceof Error) {
    const cause = (err as { cause?: unknown }).cause;
    return cause instanceof Error ? `${err.message} (${cause.message})` : err.message;
  }
  return String(err);
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}
