/**
 * DeliveryError: how the client reports what it could not deliver (to `onError`, never thrown).
 *
 * - "rejected": the server refused the events for what they are (422 validation, 413 for an
 *   event over the size limit, 401/403 for the key); resending cannot help. `status` is the
 *   HTTP status and `details` the server's `errors` (`[{index, field, message}]`, `index`
 *   into `events`). Events refused before sending (NaN/Infinity) have no `status`.
 * - "dropped": the events never left the client: the queue was full (overflow policy) or the
 *   client was already disposed.
 * - "unavailable": the server or Kafka stayed unavailable (429/5xx/network errors) through
 *   every retry. With `willRetry` the events are back in the queue for the next flush;
 *   without it (during dispose) they are discarded.
 */

import type { FeedbackEvent } from "./events.js";

/** One problem the server found: `index` into the events of the error (null: the whole request). */
export interface ServerError {
  index: number | null;
  field: string;
  message: string;
}

export type DeliveryErrorKind = "rejected" | "dropped" | "unavailable";

export class DeliveryError extends Error {
  override readonly name = "DeliveryError";
  readonly kind: DeliveryErrorKind;
  /** The events concerned. */
  readonly events: FeedbackEvent[];
  /** The HTTP status, when there was an answer. */
  readonly status?: number;
  /** The server's error body (for "rejected": its `errors` list), or what went wrong. */
  readonly details?: unknown;
  /** "unavailable" only: whether the events were queued again for the next flush. */
  readonly willRetry: boolean;

  constructor(
    kind: DeliveryErrorKind,
    events: FeedbackEvent[],
    message: string,
    extra: { status?: number | undefined; details?: unknown; willRetry?: boolean } = {},
  ) {
    super(message);
    this.kind = kind;
    this.events = events;
    if (extra.status !== undefined) {
      this.status = extra.status;
    }
    if (extra.details !== undefined) {
      this.details = extra.details;
    }
    this.willRetry = extra.willRetry ?? false;
  }
}
