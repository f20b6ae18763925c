/**
 * The interaction events of Flywheel's ingest API (`POST /v1/events`), as TypeScript types,
 * pure builders, and a machine-readable description (`EVENT_SCHEMAS`).
 *
 * The wire format is snake_case JSON, one flat object per event, discriminated by `type`
 * (docs/DESIGN.md §Editor events; the server's schema is app/contracts/events.py and is
 * published in the API's OpenAPI document under `components.schemas`). `EVENT_SCHEMAS`
 * mirrors that schema field by field (type, required, enum, bounds); the package's tests
 * compare it with the `/openapi.json` of a running API, and a type-level test checks that
 * the TypeScript types below name the same fields, so the three cannot drift apart.
 *
 * Builders fill in `event_id` (crypto.randomUUID()) and `ts` (now, UTC, in the server's
 * canonical form `YYYY-MM-DDTHH:MM:SS.ffffffZ`) when the ref does not give them, and leave
 * out optional fields that are undefined.
 */

/** What every event is about: the generation (`requestId`) and the editor session. */
export type SessionRef = {
  requestId: string;
  sessionId: string;
  modelVersion?: string;
  /** RFC 3339 timestamp with a timezone; default: now. */
  ts?: string;
  /** The idempotency key; default: a fresh UUID. Re-sending an event with the same id is safe. */
  eventId?: string;
};

/** Fields every event carries. */
export interface Envelope {
  event_id: string;
  request_id: string;
  session_id: string;
  ts: string;
  model_version?: string;
}

export interface GenerationEvent extends Envelope {
  type: "generation";
  model_version: string;
  prompt_tokens: number[];
  completion_tokens: number[];
  /** One log-probability (<= 0) per completion token. */
  logprobs: number[];
  temperature: number;
  tokenizer: string;
  /** base64 of little-endian int32 expert ids, shape `route_shape`. */
  routes?: string;
  route_shape?: [number, number, number];
  group_id?: string;
  latency_ms?: number;
  /** Why the completion ended; "cancelled": the client went away mid-stream; "tool_calls": a chat
   * completion that ended after its tool calls. */
  finish_reason?: "stop" | "length" | "cancelled" | "tool_calls";
  /** Whether the completion was streamed to the client. */
  stream?: boolean;
  /** Chat turns (docs/AGENTS.md): the assistant messages in the request's history. */
  turn?: number;
  tool_choice?: "none" | "auto" | "required" | "function";
  /** sha256 hex of the tools' canonical JSON. */
  tools_digest?: string;
  /** Sampled under the tool-call grammar: `logprobs` are of the masked distribution. */
  constrained?: boolean;
  tool_calls?: ToolCallRecord[];
  /** Text in the model's call format that is not a call (returned as content, never repaired). */
  invalid_tool_calls?: { text: string; error: string }[];
}

/** A call the model made, as the replica returned it. */
export interface ToolCallRecord {
  id: string;
  name: string;
  /** The JSON text of the arguments, as the model wrote it. */
  arguments: string;
  /** Whether the arguments validate against the function's schema. */
  arguments_valid: boolean;
  arguments_error?: string;
}

export interface AcceptEvent extends Envelope {
  type: "accept";
}

export interface RejectEvent extends Envelope {
  type: "reject";
}

export interface EditPersistenceEvent extends Envelope {
  type: "edit_persistence";
  /** Share of the accepted text still in the document, 0..1. */
  fraction: number;
  /** Seconds after the accept at which `fraction` was measured (> 0). */
  after_s: number;
}

export interface RatingEvent extends Envelope {
  type: "rating";
  value: 1 | -1;
}

export interface ToolErrorEvent extends Envelope {
  type: "tool_error";
  message: string;
  hint?: string;
  /** Index of the completion token the error points at. */
  token_index: number;
}

export interface FollowupEvent extends Envelope {
  type: "followup";
  /** -1 (negative) .. 1 (positive). */
  sentiment: number;
}

/** How an agent session ended; `request_id` names its last generation (one per session). */
export interface SessionOutcomeEvent extends Envelope {
  type: "session_outcome";
  outcome: "success" | "failure" | "abandoned";
}

export type FeedbackEvent =
  | GenerationEvent
  | AcceptEvent
  | RejectEvent
  | EditPersistenceEvent
  | RatingEvent
  | ToolErrorEvent
  | FollowupEvent
  | SessionOutcomeEvent;

export type EventType = FeedbackEvent["type"];

// --- the machine-readable description -------------------------------------------------------

/** One field of an event as JSON Schema says it (the subset the ingest schema uses). */
export interface FieldSchema {
  readonly type: "string" | "integer" | "number" | "boolean" | "array" | "object";
  readonly pattern?: string;
  readonly properties?: { readonly [name: string]: FieldSchema };
  readonly required?: readonly string[];
  readonly enum?: readonly (string | number)[];
  readonly format?: string;
  readonly minimum?: number;
  readonly maximum?: number;
  readonly exclusiveMinimum?: number;
  readonly minLength?: number;
  readonly maxLength?: number;
  readonly minItems?: number;
  readonly maxItems?: number;
  readonly items?: FieldSchema;
}

/** One event type: every field it may carry, and the ones it must. Unknown fields are refused. */
export interface EventSchema {
  readonly fields: { readonly [name: string]: FieldSchema };
  readonly required: readonly string[];
}

const ID = { type: "string", minLength: 1, maxLength: 128 } as const;
const ENVELOPE_FIELDS = {
  event_id: ID,
  request_id: ID,
  session_id: ID,
  ts: { type: "string", format: "date-time" },
  model_version: { type: "string" },
} as const;
const ENVELOPE_REQUIRED = ["event_id", "request_id", "session_id", "ts", "type"] as const;
const NON_NEGATIVE_INT = { type: "integer", minimum: 0 } as const;
const MAX_TEXT = 4096;
const MAX_TOOL_CALLS = 1024;
const MAX_TOOL_TEXT = 262144;
const TOOL_CALL_RECORD = {
  type: "object",
  properties: {
    id: ID,
    name: { type: "string", minLength: 1, maxLength: 64 },
    arguments: { type: "string", maxLength: MAX_TOOL_TEXT },
    arguments_valid: { type: "boolean" },
    arguments_error: { type: "string", maxLength: 2000 },
  },
  required: ["id", "name", "arguments", "arguments_valid"],
} as const;
const INVALID_TOOL_CALL = {
  type: "object",
  properties: {
    text: { type: "string", maxLength: MAX_TOOL_TEXT },
    error: { type: "string", maxLength: 2000 },
  },
  required: ["text", "error"],
} as const;

/** Every event type of the ingest schema, field by field (checked against the API's OpenAPI document). */
export const EVENT_SCHEMAS = {
  generation: {
    fields: {
      ...ENVELOPE_FIELDS,
      type: { type: "string", enum: ["generation"] },
      model_version: { type: "string", minLength: 1 },
      prompt_tokens: { type: "array", items: NON_NEGATIVE_INT },
      completion_tokens: { type: "array", items: NON_NEGATIVE_INT, minItems: 1, maxItems: 32768 },
      logprobs: { type: "array", items: { type: "number", maximum: 0 } },
      routes: { type: "string" },
      route_shape: { type: "array", items: NON_NEGATIVE_INT, minItems: 3, maxItems: 3 },
      temperature: { type: "number", minimum: 0, maximum: 100 },
      group_id: ID,
      latency_ms: { type: "number", minimum: 0 },
      tokenizer: { type: "string", minLength: 1, maxLength: 64 },
      finish_reason: { type: "string", enum: ["stop", "length", "cancelled", "tool_calls"] },
      stream: { type: "boolean" },
      turn: NON_NEGATIVE_INT,
      tool_choice: { type: "string", enum: ["none", "auto", "required", "function"] },
      tools_digest: { type: "string", pattern: "^[0-9a-f]{64}$" },
      constrained: { type: "boolean" },
      tool_calls: { type: "array", items: TOOL_CALL_RECORD, maxItems: MAX_TOOL_CALLS },
      invalid_tool_calls: { type: "array", items: INVALID_TOOL_CALL, maxItems: MAX_TOOL_CALLS },
    },
    required: [
      ...ENVELOPE_REQUIRED,
      "model_version",
      "prompt_tokens",
      "completion_tokens",
      "logprobs",
      "temperature",
      "tokenizer",
    ],
  },
  accept: {
    fields: { ...ENVELOPE_FIELDS, type: { type: "string", enum: ["accept"] } },
    required: ENVELOPE_REQUIRED,
  },
  reject: {
    fields: { ...ENVELOPE_FIELDS, type: { type: "string", enum: ["reject"] } },
    required: ENVELOPE_REQUIRED,
  },
  edit_persistence: {
    fields: {
      ...ENVELOPE_FIELDS,
      type: { type: "string", enum: ["edit_persistence"] },
      fraction: { type: "number", minimum: 0, maximum: 1 },
      after_s: { type: "number", exclusiveMinimum: 0 },
    },
    required: [...ENVELOPE_REQUIRED, "fraction", "after_s"],
  },
  rating: {
    fields: {
      ...ENVELOPE_FIELDS,
      type: { type: "string", enum: ["rating"] },
      value: { type: "integer", enum: [-1, 1] },
    },
    required: [...ENVELOPE_REQUIRED, "value"],
  },
  tool_error: {
    fields: {
      ...ENVELOPE_FIELDS,
      type: { type: "string", enum: ["tool_error"] },
      message: { type: "string", maxLength: MAX_TEXT },
      hint: { type: "string", maxLength: MAX_TEXT },
      token_index: NON_NEGATIVE_INT,
    },
    required: [...ENVELOPE_REQUIRED, "message", "token_index"],
  },
  followup: {
    fields: {
      ...ENVELOPE_FIELDS,
      type: { type: "string", enum: ["followup"] },
      sentiment: { type: "number", minimum: -1, maximum: 1 },
    },
    required: [...ENVELOPE_REQUIRED, "sentiment"],
  },
  session_outcome: {
    fields: {
      ...ENVELOPE_FIELDS,
      type: { type: "string", enum: ["session_outcome"] },
      outcome: { type: "string", enum: ["success", "failure", "abandoned"] },
    },
    required: [...ENVELOPE_REQUIRED, "outcome"],
  },
} as const satisfies { readonly [T in EventType]: EventSchema };

export const EVENT_TYPES = Object.keys(EVENT_SCHEMAS) as EventType[];

// --- builders --------------------------------------------------------------------------------

/** Now, in the canonical timestamp form the API writes to Kafka (UTC, microseconds, "Z"). */
export function nowTimestamp(): string {
  return new Date().toISOString().replace(/Z$/, "000Z"); // toISOString has milliseconds
}

/** Copy of `obj` without the keys whose value is undefined (optional fields left out). */
function defined<T>(obj: { [key: string]: unknown }): T {
  return Object.fromEntries(Object.entries(obj).filter(([, v]) => v !== undefined)) as T;
}

function envelope(ref: SessionRef): Envelope {
  return defined<Envelope>({
    event_id: ref.eventId ?? globalThis.crypto.randomUUID(),
    request_id: ref.requestId,
    session_id: ref.sessionId,
    ts: ref.ts ?? nowTimestamp(),
    model_version: ref.modelVersion,
  });
}

export type GenerationFields = {
  modelVersion: string;
  promptTokens: number[];
  completionTokens: number[];
  logprobs: number[];
  temperature: number;
  /** default "byte-v1" */
  tokenizer?: string;
  routes?: string;
  routeShape?: [number, number, number];
  groupId?: string;
  latencyMs?: number;
  finishReason?: "stop" | "length" | "cancelled";
  stream?: boolean;
};

export function generationEvent(ref: SessionRef & GenerationFields): GenerationEvent {
  return defined<GenerationEvent>({
    ...envelope(ref),
    type: "generation",
    model_version: ref.modelVersion,
    prompt_tokens: ref.promptTokens,
    completion_tokens: ref.completionTokens,
    logprobs: ref.logprobs,
    temperature: ref.temperature,
    tokenizer: ref.tokenizer ?? "byte-v1",
    routes: ref.routes,
    route_shape: ref.routeShape,
    group_id: ref.groupId,
    latency_ms: ref.latencyMs,
    finish_reason: ref.finishReason,
    stream: ref.stream,
  });
}

export function acceptEvent(ref: SessionRef): AcceptEvent {
  return { ...envelope(ref), type: "accept" };
}

export function rejectEvent(ref: SessionRef): RejectEvent {
  return { ...envelope(ref), type: "reject" };
}

export function editPersistenceEvent(
  ref: SessionRef & { fraction: number; afterS: number },
): EditPersistenceEvent {
  return { ...envelope(ref), type: "edit_persistence", fraction: ref.fraction, after_s: ref.afterS };
}

export function ratingEvent(ref: SessionRef & { value: 1 | -1 }): RatingEvent {
  return { ...envelope(ref), type: "rating", value: ref.value };
}

export function toolErrorEvent(
  ref: SessionRef & { message: string; hint?: string; tokenIndex: number },
): ToolErrorEvent {
  return defined<ToolErrorEvent>({
    ...envelope(ref),
    type: "tool_error",
    message: ref.message,
    hint: ref.hint,
    token_index: ref.tokenIndex,
  });
}

export function followupEvent(ref: SessionRef & { sentiment: number }): FollowupEvent {
  return { ...envelope(ref), type: "followup", sentiment: ref.sentiment };
}

export function sessionOutcomeEvent(
  ref: SessionRef & { outcome: SessionOutcomeEvent["outcome"] },
): SessionOutcomeEvent {
  return { ...envelope(ref), type: "session_outcome", outcome: ref.outcome };
}
