/**
 * Edit persistence: how much of an accepted completion is still in the document some time later.
 *
 * The reward spec (docs/DESIGN.md "Reward spec") adds `1.0 × fraction` of the latest
 * `edit_persistence` event of an accepted completion; the event carries `fraction` in [0, 1] and
 * `after_s`, the seconds between the accept and the measurement. This module defines the fraction
 * and keeps no state, so it can be tested without VS Code:
 *
 *   fraction = LCS(accepted, window) / accepted.length
 *
 * where LCS is the length of the longest common subsequence (in UTF-16 code units, as VS Code's
 * offsets are) and `window` is the document text of the completion's span, carried through every
 * later edit by `mapSpan`: the characters of the accepted text still present, in order, in the
 * part of the document that grew out of it. Untouched: 1. Deleted: 0. Half rewritten: about 0.5.
 *
 * `mapSpan` applies one edit (VS Code's `TextDocumentContentChangeEvent`: a replaced range in the
 * text before the edit, and the length of what replaced it):
 * - an edit that ends at or before the span's start shifts it (typing right before the
 *   completion is not part of it); one that starts at or after its end leaves it alone;
 * - an edit that overlaps the span merges with it: the span grows to cover the replacement text,
 *   so typing inside the completion lands in the window and is measured against it;
 * - if the merged span would be longer than `maxSpanLength(accepted)` (the edit rewrote far
 *   more than the completion: a whole-file format, a paste over the file), the span keeps its
 *   own offset and length, clamped into the replacement, since such edits mostly leave text
 *   where it was. The bound also keeps the LCS cheap: O(n × (2n + 64)) for an n-character
 *   completion.
 */

/** A range of document offsets, `end` exclusive. */
export interface Span {
  readonly start: number;
  readonly end: number;
}

/** One edit: the offsets [start, end) of the text before it were replaced by `insertedLength` characters. */
export interface Edit {
  readonly start: number;
  readonly end: number;
  readonly insertedLength: number;
}

/** The longest the tracked span of an `acceptedLength`-character completion may grow. */
export function maxSpanLength(acceptedLength: number): number {
  return 2 * acceptedLength + 64;
}

/** The span after `edit` (see the module docstring for the rules). */
export function mapSpan(span: Span, edit: Edit, maxLength: number): Span {
  if (edit.start > edit.end || edit.insertedLength < 0) {
    throw new RangeError(`invalid edit ${JSON.stringify(edit)}`);
  }
  const delta = edit.insertedLength - (edit.end - edit.start);
  if (edit.end <= span.start) {
    return { start: span.start + delta, end: span.end + delta };
  }
  if (edit.start >= span.end) {
    return span;
  }
  const merged = {
    start: Math.min(span.start, edit.start),
    end: Math.max(span.end + delta, edit.start + edit.insertedLength),
  };
  if (merged.end - merged.start <= maxLength) {
    return merged;
  }
  const start = Math.min(Math.max(span.start, merged.start), merged.end);
  const end = Math.min(start + (span.end - span.start), merged.end);
  return { start, end };
}

/**
 * Length of the longest common subsequence of `a` and `b` (UTF-16 code units), in O(|a|·|b|)
 * time and O(|b|) memory.
 */
export function lcsLength(a: string, b: string): number {
  if (a.length === 0 || b.length === 0) {
    return 0;
  }
  // rows of the DP table; every index below is within [0, b.length]
  let previous = new Uint32Array(b.length + 1);
  let current = new Uint32Array(b.length + 1);
  for (let i = 1; i <= a.length; i++) {
    const ai = a.charCodeAt(i - 1);
    for (let j = 1; j <= b.length; j++) {
      current[j] =
        ai === b.charCodeAt(j - 1) ? previous[j - 1]! + 1 : Math.max(previous[j]!, current[j - 1]!);
    }
    [previous, current] = [current, previous];
  }
  return previous[b.length]!;
}

/** The share of `accepted` still present in `window`, in [0, 1], rounded to 3 decimals. */
export function persistedFraction(accepted: string, window: string): number {
  if (accepted.length === 0) {
    throw new RangeError("the accepted text is empty: there is nothing to measure");
  }
  const fraction = lcsLength(accepted, window) / accepted.length;
  return Math.round(fraction * 1000) / 1000;
}
