/**
 * The extension's settings (`flywheel.*`, declared with their descriptions and bounds in
 * package.json `contributes.configuration`), read and checked in one place.
 *
 * VS Code does not enforce a setting's JSON schema on what a user types into settings.json, so
 * `readSettings` checks every value again and throws a `SettingsError` listing each bad one by
 * name; the extension then shows it and offers no completions until the settings are fixed.
 */
import * as vscode from "vscode";

export interface Settings {
  /** Base URL of the replica (POST {replicaUrl}/v1/completions), without a trailing slash. */
  readonly replicaUrl: string;
  /** Serving key of the replica, or "" for none. */
  readonly replicaApiKey: string;
  /** The `model` field of completion requests; "" sends none (the replica's served model). */
  readonly model: string;
  /** Base URL of the ingest API (POST {ingestUrl}/v1/events), without a trailing slash. */
  readonly ingestUrl: string;
  /** Ingest API key, or "" (then no feedback is sent). */
  readonly ingestApiKey: string;
  readonly maxTokens: number;
  readonly temperature: number;
  /** `n` for explicitly triggered suggestions (automatic ones ask for 1). */
  readonly choicesOnInvoke: number;
  readonly stop: readonly string[];
  /** Characters before the cursor sent as the prompt. */
  readonly promptChars: number;
  readonly requestTimeoutMs: number;
  /** Seconds after an accept at which persistence is measured, ascending, without repeats. */
  readonly persistenceDelaysS: readonly number[];
}

export class SettingsError extends Error {
  constructor(readonly problems: readonly string[]) {
    super(`Flywheel settings: ${problems.join("; ")}`);
    this.name = "SettingsError";
  }
}

export function readSettings(config: vscode.WorkspaceConfiguration): Settings {
  const problems: string[] = [];
  const url = (key: string): string => {
    const value = config.get<unknown>(key);
    if (typeof value !== "string") {
      problems.push(`flywheel.${key} must be a URL string`);
      return "";
    }
    try {
      const parsed = new URL(value);
      if (parsed.protocol !== "http:" && parsed.protocol !== "https:") {
        problems.push(`flywheel.${key} must be an http(s) URL, got ${JSON.stringify(value)}`);
      }
    } catch {
      problems.push(`flywheel.${key} is not a URL: ${JSON.stringify(value)}`);
    }
    return value.replace(/\/+$/, "");
  };
  const text = (key: string, minLength: number): string => {
    const value = config.get<unknown>(key);
    if (typeof value !== "string" || value.length < minLength) {
      problems.push(`flywheel.${key} must be a string of at least ${minLength} characters`);
      return "";
    }
    return value;
  };
  const number = (key: string, min: number, max: number, integer: boolean): number => {
    const value = config.get<unknown>(key);
    if (
      typeof value !== "number" ||
      !Number.isFinite(value) ||
      (integer && !Number.isInteger(value)) ||
      value < min ||
      value > max
    ) {
      problems.push(
        `flywheel.${key} must be ${integer ? "an integer" : "a number"} in [${min}, ${max}], got ${JSON.stringify(value)}`,
      );
      return min;
    }
    return value;
  };
  const stop = config.get<unknown>("stop");
  const stopOk =
    Array.isArray(stop) && stop.length <= 4 && stop.every((s) => typeof s === "string" && s.length > 0);
  if (!stopOk) {
    problems.push("flywheel.stop must be a list of at most 4 non-empty strings");
  }
  const delays = config.get<unknown>("persistenceDelaysS");
  const delaysOk =
    Array.isArray(delays) &&
    delays.length >= 1 &&
    delays.length <= 8 &&
    delays.every((d) => typeof d === "number" && Number.isFinite(d) && d > 0 && d <= 600);
  if (!delaysOk) {
    problems.push(
      `flywheel.persistenceDelaysS must be 1 to 8 numbers of seconds in (0, 600], got ${JSON.stringify(delays)}`,
    );
  }
  const settings: Settings = {
    replicaUrl: url("replicaUrl"),
    replicaApiKey: text("replicaApiKey", 0),
    model: text("model", 0),
    ingestUrl: url("ingestUrl"),
    ingestApiKey: text("ingestApiKey", 0),
    maxTokens: number("maxTokens", 1, 4096, true),
    temperature: number("temperature", 0, 2, false),
    choicesOnInvoke: number("choicesOnInvoke", 1, 8, true),
    stop: stopOk ? (stop as string[]) : [],
    promptChars: number("promptChars", 1, 100_000, true),
    requestTimeoutMs: number("requestTimeoutMs", 100, 120_000, true),
    persistenceDelaysS: delaysOk ? [...new Set(delays as number[])].sort((a, b) => a - b) : [],
  };
  if (problems.length > 0) {
    throw new SettingsError(problems);
  }
  return settings;
}
