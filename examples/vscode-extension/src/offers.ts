/**
 * Shown suggestions ("offers") and when one counts as rejected.
 *
 * VS Code's stable API says when a suggestion is accepted (the item's `command` runs after the
 * insertion) but not when it is dismissed, so a reject is inferred. An offer is one answer of the
 * replica shown at an anchor (the cursor offset when it was requested, carried through edits
 * before it). It is *open* until one of:
 *
 * - accepted: the item's command ran;
 * - rejected: the user pressed Escape while it was visible (the extension binds Escape for
 *   that), switched to another editor, moved the cursor before the anchor or off the text the
 *   suggestion would have written, or typed something it does not start with (overwrote it).
 *   In each case the text from the anchor to the cursor is no longer a prefix of any choice;
 * - passed (no decision): a new suggestion was requested while the user was still typing along
 *   this one (VS Code asks again on every keystroke), or the user typed a whole choice and went
 *   on. A passed offer can still be accepted: VS Code may keep showing it.
 *
 * Every choice of an open offer counts as shown; a dismissed offer rejects them all (with n = 1,
 * the default for automatic suggestions, that is the one shown). Accepting one choice leaves the
 * others undecided. A suggestion VS Code was given but decided not to render is
 * indistinguishable from a shown one here.
 *
 * No VS Code import: the extension supplies the typed text.
 */
import type { Choice } from "./replica";

export type OfferState = "open" | "accepted" | "rejected" | "passed";

export interface Offer {
  readonly id: number;
  readonly documentUri: string;
  /** Document offset where the suggestion starts, moved by edits before it. */
  anchor: number;
  readonly choices: readonly Choice[];
  readonly modelVersion: string | undefined;
  state: OfferState;
}

export type Verdict = "keep" | "reject" | "pass";

/**
 * What the text typed since the offer says about it. `typed` is the document text from the
 * anchor to the cursor, or undefined when the cursor is before the anchor, on a selection, or in
 * another editor.
 */
export function verdict(choices: readonly Choice[], typed: string | undefined): Verdict {
  if (typed === undefined) {
    return "reject";
  }
  if (choices.some((c) => c.text.startsWith(typed))) {
    return "keep";
  }
  if (choices.some((c) => typed.startsWith(c.text))) {
    return "pass";
  }
  return "reject";
}

/** The longest text worth reading from the anchor: anything longer is off every choice. */
export function longestChoice(offer: Offer): number {
  return Math.max(...offer.choices.map((c) => c.text.length));
}

/**
 * The offers of this session: the open one per document, and the recent ones by id (for the
 * accept command, which may name an offer that was passed). Holds at most `capacity` offers.
 */
export class OfferBook {
  private nextId = 1;
  private readonly byId = new Map<number, Offer>();
  private readonly openByDocument = new Map<string, Offer>();

  constructor(private readonly capacity = 256) {}

  /** Records a newly shown offer; the document's previous open offer is passed. */
  add(
    documentUri: string,
    anchor: number,
    choices: readonly Choice[],
    modelVersion: string | undefined,
  ): Offer {
    const previous = this.open(documentUri);
    if (previous !== undefined) {
      this.settle(previous, "passed");
    }
    const offer: Offer = { id: this.nextId++, documentUri, anchor, choices, modelVersion, state: "open" };
    this.byId.set(offer.id, offer);
    this.openByDocument.set(documentUri, offer);
    for (const id of this.byId.keys()) {
      if (this.byId.size <= this.capacity) {
        break;
      }
      this.byId.delete(id); // Map iterates in insertion order: the oldest first
    }
    return offer;
  }

  get(id: number): Offer | undefined {
    return this.byId.get(id);
  }

  /** The open offer of a document, if any. */
  open(documentUri: string): Offer | undefined {
    const offer = this.openByDocument.get(documentUri);
    return offer?.state === "open" ? offer : undefined;
  }

  /** Every open offer (at most one per document). */
  allOpen(): Offer[] {
    return [...this.openByDocument.values()].filter((o) => o.state === "open");
  }

  /**
   * Moves an offer on: open -> passed, rejected or accepted; passed -> accepted (VS Code may
   * still show a passed offer). Returns false, changing nothing, for any other move.
   */
  settle(offer: Offer, state: Exclude<OfferState, "open">): boolean {
    const allowed = offer.state === "open" || (offer.state === "passed" && state === "accepted");
    if (!allowed) {
      return false;
    }
    offer.state = state;
    if (this.openByDocument.get(offer.documentUri) === offer) {
      this.openByDocument.delete(offer.documentUri);
    }
    return true;
  }
}
