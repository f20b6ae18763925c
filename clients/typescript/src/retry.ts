/**
 * When to retry and how long to wait: pure functions, so they are tested without a clock.
 */

/** Answers retried with the same body: rate limited, and the server or Kafka unavailable. */
export const RETRY_STATUSES: ReadonlySet<number> = new Set([429, 500, 502, 503, 504]);

/** A Retry-After longer than this is cut to it (a misconfigured server cannot park the client). */
export const MAX_RETRY_AFTER_MS = 60_000;

/**
 * The wait before retry `attempt` (0-based): uniform in [b/2, b] with
 * b = min(maxBackoffMs, minBackoffMs * 2^attempt), `random` in [0, 1). A server's
 * Retry-After wins when it is longer.
 */
export function backoffDelayMs(
  attempt: number,
  limits: { minBackoffMs: number; maxBackoffMs: number },
  random: number,
  retryAfterMs?: number,
): number {
  const b = Math.min(limits.maxBackoffMs, limits.minBackoffMs * 2 ** attempt);
  const jittered = b / 2 + random * (b / 2);
  return retryAfterMs !== undefined ? Math.max(jittered, retryAfterMs) : jittered;
}

/** A Retry-After header (delay-seconds or an HTTP date) in ms, capped at MAX_RETRY_AFTER_MS; undefined if absent or unreadable. */
export function retryAfterMs(header: string | null, now: number = Date.now()): number | undefined {
  if (header === null || header.trim() === "") {
    return undefined;
  }
  const value = header.trim();
  let ms: number;
  if (/^\d+(\.\d+)?$/.test(value)) {
    ms = Number(value) * 1000;
  } else {
    const date = Date.parse(value);
    if (Number.isNaN(date)) {
      return undefined;
    }
    ms = date - now;
  }
  return Math.min(MAX_RETRY_AFTER_MS, Math.max(0, ms));
}
