/**
 * Completions from a Flywheel replica through its OpenAI-compatible API, with plain `fetch`.
 *
 *   POST {replicaUrl}/v1/completions
 *   {model?, prompt, max_tokens, temperature, n, stop, user, stream: false}
 *
 * `user` is the editor session: the replica picks the champion or the candidate model by it, and
 * the feedback events carry the same value as `session_id`. The response's `id` is Flywheel's
 * request_id, the id feedback events are keyed by; with n > 1 each choice carries its own
 * `request_id`. The model version comes from the `X-Flywheel-Model-Version` header (or
 * `system_fingerprint`, `flywheel-v<version>`) and is passed on with the feedback. Without a
 * `model` the replica answers with the model it serves.
 *
 * The replica writes the `generation` event itself, so the editor sends only feedback.
 * Inline suggestions are shown whole, so the request is not streamed; aborting it (VS Code
 * cancels a request the user typed past) just drops the answer.
 */

/** One suggestion: its text and the request_id its feedback is keyed by. */
export interface Choice {
  readonly requestId: string;
  readonly text: string;
}

export interface Completion {
  readonly choices: readonly Choice[];
  /** The serving model's version, when the replica named it. */
  readonly modelVersion: string | undefined;
}

export interface CompletionRequest {
  readonly replicaUrl: string;
  readonly apiKey: string;
  /** "" leaves `model` out. */
  readonly model: string;
  readonly prompt: string;
  readonly maxTokens: number;
  readonly temperature: number;
  readonly n: number;
  readonly stop: readonly string[];
  readonly sessionId: string;
  readonly timeoutMs: number;
  readonly signal: AbortSignal;
}

/** The replica refused the request or answered with something that is not a completion. */
export class ReplicaError extends Error {
  constructor(
    message: string,
    readonly status?: number,
  ) {
    super(message);
    this.name = "ReplicaError";
  }
}

export async function complete(req: CompletionRequest): Promise<Completion> {
  const headers: Record<string, string> = { "content-type": "application/json" };
  if (req.apiKey !== "") {
    headers.authorization = `Bearer ${req.apiKey}`;
  }
  const response = await fetch(`${req.replicaUrl}/v1/completions`, {
    method: "POST",
    headers,
    body: JSON.stringify({
      model: req.model !== "" ? req.model : undefined,
      prompt: req.prompt,
      max_tokens: req.maxTokens,
      temperature: req.temperature,
      n: req.n,
      stop: req.stop.length > 0 ? req.stop : undefined,
      user: req.sessionId,
      stream: false,
    }),
    signal: AbortSignal.any([req.signal, AbortSignal.timeout(req.timeoutMs)]),
  });
  const body: unknown = await response.json().catch(() => undefined);
  if (!response.ok) {
    throw new ReplicaError(
      `the replica answered ${response.status}: ${errorMessage(body) ?? response.statusText}`,
      response.status,
    );
  }
  return parseCompletion(body, req.n, response.headers.get("x-flywheel-model-version"));
}

/** The `error.message` of an OpenAI-format error body, if it is one. */
function errorMessage(body: unknown): string | undefined {
  if (isObject(body) && isObject(body.error) && typeof body.error.message === "string") {
    return body.error.message;
  }
  return undefined;
}

/** Checks the response body's shape; choices come back ordered by their `index`. */
export function parseCompletion(body: unknown, n: number, versionHeader: string | null): Completion {
  if (!isObject(body) || typeof body.id !== "string" || !Array.isArray(body.choices)) {
    throw new ReplicaError("the replica's response is not a completion (no `id` or `choices`)");
  }
  const id = body.id;
  if (body.choices.length !== n) {
    throw new ReplicaError(`asked for ${n} choices, the replica returned ${body.choices.length}`);
  }
  const choices = body.choices.map((raw: unknown, i: number): Choice & { index: number } => {
    if (!isObject(raw) || typeof raw.text !== "string" || typeof raw.index !== "number") {
      throw new ReplicaError(`choice ${i} of the replica's response has no \`text\` or \`index\``);
    }
    const requestId = typeof raw.request_id === "string" ? raw.request_id : n === 1 ? id : undefined;
    if (requestId === undefined) {
      throw new ReplicaError(`choice ${i} of an n=${n} response has no \`request_id\``);
    }
    return { requestId, text: raw.text, index: raw.index };
  });
  choices.sort((a, b) => a.index - b.index);
  const fingerprint =
    typeof body.system_fingerprint === "string"
      ? body.system_fingerprint.replace(/^flywheel-v(?=.)/, "")
      : undefined;
  return {
    choices: choices.map(({ requestId, text }) => ({ requestId, text })),
    modelVersion: versionHeader ?? fingerprint,
  };
}

function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}
