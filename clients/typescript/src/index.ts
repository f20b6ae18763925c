/**
 * @flywheel/feedback-client: send editor feedback to Flywheel's ingest API.
 *
 *     import { FeedbackClient } from "@flywheel/feedback-client";
 *     const client = new FeedbackClient({ baseUrl, apiKey, onError: (e) => log(e.message) });
 *     client.accept({ requestId, sessionId });   // returns the event_id; never throws
 *     await client.dispose();                    // flushes what is queued
 *
 * Modules: events.ts (types, builders, EVENT_SCHEMAS), client.ts (FeedbackClient),
 * errors.ts (DeliveryError), retry.ts (backoff and Retry-After).
 */

export * from "./events.js";
export { FeedbackClient, type FeedbackClientOptions } from "./client.js";
export { DeliveryError, type DeliveryErrorKind, type ServerError } from "./errors.js";
export { RETRY_STATUSES, MAX_RETRY_AFTER_MS, backoffDelayMs, retryAfterMs } from "./retry.js";
