/**
 * The edit-persistence measure (src/persistence.ts): span tracking through edits and the
 * LCS fraction, replayed on plain strings the way VS Code reports edits.
 */
import assert from "node:assert/strict";
import { describe, it } from "node:test";
import {
  type Edit,
  lcsLength,
  mapSpan,
  maxSpanLength,
  persistedFraction,
  type Span,
} from "../src/persistence";

/** Applies `edits` (in order) to `text` and to the span of `accepted` in it; returns the fraction. */
function replay(
  before: string,
  accepted: string,
  edits: { at: number; remove: number; insert: string }[],
): number {
  let text = before + accepted;
  let span: Span = { start: before.length, end: before.length + accepted.length };
  for (const e of edits) {
    const edit: Edit = { start: e.at, end: e.at + e.remove, insertedLength: e.insert.length };
    text = text.slice(0, e.at) + e.insert + text.slice(e.at + e.remove);
    span = mapSpan(span, edit, maxSpanLength(accepted.length));
    assert.ok(
      0 <= span.start && span.start <= span.end && span.end <= text.length,
      `span ${JSON.stringify(span)} outside the text`,
    );
  }
  return persistedFraction(accepted, text.slice(span.start, span.end));
}

describe("lcsLength", () => {
  it("is the longest common subsequence", () => {
    assert.equal(lcsLength("ABCBDAB", "BDCABA"), 4);
    assert.equal(lcsLength("", "abc"), 0);
    assert.equal(lcsLength("abc", "abc"), 3);
    assert.equal(lcsLength("abc", "xyz"), 0);
  });
});

describe("persistedFraction", () => {
  const accepted = "return a + b;";

  it("is 1 for an untouched completion, whatever is typed around it", () => {
    const before = "function add(a, b) {\n  ";
    const comment = "// sum\n";
    assert.equal(
      replay(before, accepted, [
        { at: 0, remove: 0, insert: comment }, // before it: shifts the span
        { at: comment.length + before.length + accepted.length, remove: 0, insert: "\n}" }, // right after it
        { at: comment.length + before.length, remove: 0, insert: "  " }, // right at its start
      ]),
      1,
    );
  });

  it("is 0 once the completion is deleted", () => {
    assert.equal(replay("x = ", accepted, [{ at: 4, remove: accepted.length, insert: "" }]), 0);
  });

  it("counts what is left after an edit inside the completion", () => {
    // "a + b" -> "a - b": one of 13 characters replaced
    assert.equal(replay("", accepted, [{ at: 9, remove: 1, insert: "-" }]), 0.923);
    // the second half deleted and retyped differently
    assert.equal(replay("", "abcdefgh", [{ at: 4, remove: 4, insert: "wxyz" }]), 0.5);
  });

  it("keeps its place when an edit rewrites far more than the completion", () => {
    const before = "x".repeat(500);
    const after = "z".repeat(500);
    const whole = before + accepted + after;
    // a whole-file replace (as some formatters do) that keeps the text where it was
    const fraction = replay(before, accepted, [
      { at: whole.length - after.length, remove: 0, insert: after },
      { at: 0, remove: whole.length, insert: whole },
    ]);
    assert.equal(fraction, 1);
    // the same rewrite without the completion: gone, though its text still stands elsewhere in the file
    const without = replay(before, accepted, [
      { at: whole.length - after.length, remove: 0, insert: after },
      { at: 0, remove: whole.length, insert: `// ${accepted}\n${before}${after}` },
    ]);
    assert.equal(without, 0);
  });

  it("refuses an empty accepted text", () => {
    assert.throws(() => persistedFraction("", "abc"), RangeError);
  });
});
