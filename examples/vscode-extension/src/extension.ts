/**
 * A minimal VS Code extension: inline completions from a Flywheel replica, and the editor's
 * feedback on them sent to the ingest API through `@flywheel/feedback-client`.
 *
 * For one suggestion the extension emits (README.md, "The event timeline of one suggestion"):
 *
 *   replica  generation        written by the replica when it answers POST /v1/completions
 *   editor   accept | reject   accept when the item's command runs; reject when it is dismissed (offers.ts)
 *   editor   edit_persistence  for an accept, at each of flywheel.persistenceDelaysS (persistence.ts)
 *   editor   rating            flywheel.rateUp / flywheel.rateDown, on the last accepted suggestion
 *
 * All events of one VS Code window share `session_id` = `vscode.env.sessionId`, which is also
 * the `user` of the completion requests (the replica's champion/candidate split). Delivery
 * failures never reach the UI: the client reports them to `onError`, logged in the "Flywheel"
 * output channel. Deactivation sends the pending rejects, takes the pending persistence
 * measurements and flushes the client.
 */
import * as vscode from "vscode";
import { type DeliveryError, FeedbackClient, type SessionRef } from "@flywheel/feedback-client";
import { readSettings, type Settings } from "./config";
import { longestChoice, type Offer, OfferBook, verdict } from "./offers";
import { type Edit, mapSpan, maxSpanLength, persistedFraction, type Span } from "./persistence";
import { type Choice, complete } from "./replica";

const ACCEPTED_COMMAND = "flywheel.accepted";
/**
 * How long a reject waits before it is sent. VS Code inserts an accepted suggestion before it
 * runs the accept command, and that insertion can look like an overwrite of a newer suggestion
 * at the same spot; an accept in the same document within this time withdraws the reject.
 */
const REJECT_GRACE_MS = 500;

/** An accepted suggestion whose persistence is still to be measured. */
interface Accepted {
  readonly ref: SessionRef;
  readonly documentUri: string;
  readonly text: string;
  span: Span;
  readonly acceptedAtMs: number;
  readonly timers: ReturnType<typeof setTimeout>[];
  measurementsLeft: number;
}

let session: FlywheelSession | undefined;

export function activate(context: vscode.ExtensionContext): void {
  session = new FlywheelSession();
  context.subscriptions.push(session);
}

export function deactivate(): Promise<void> | undefined {
  return session?.dispose();
}

class FlywheelSession implements vscode.Disposable, vscode.InlineCompletionItemProvider {
  private readonly log = vscode.window.createOutputChannel("Flywheel", { log: true });
  private readonly sessionId = vscode.env.sessionId;
  private readonly offers = new OfferBook();
  private readonly accepted = new Set<Accepted>();
  private readonly pendingRejects = new Map<Offer, ReturnType<typeof setTimeout>>();
  private readonly disposables: vscode.Disposable[] = [];
  private settings: Settings | undefined;
  private feedback: FeedbackClient | undefined;
  private lastAccepted: SessionRef | undefined;
  private disposed: Promise<void> | undefined;

  constructor() {
    this.loadSettings();
    const selector = [{ scheme: "file" }, { scheme: "untitled" }];
    this.disposables.push(
      this.log,
      vscode.languages.registerInlineCompletionItemProvider(selector, this),
      vscode.commands.registerCommand(ACCEPTED_COMMAND, (offerId: number, choice: number) =>
        this.onAccepted(offerId, choice),
      ),
      vscode.commands.registerCommand("flywheel.dismiss", () => this.onDismiss()),
      vscode.commands.registerCommand("flywheel.rateUp", () => this.rate(1)),
      vscode.commands.registerCommand("flywheel.rateDown", () => this.rate(-1)),
      vscode.workspace.onDidChangeTextDocument((e) => this.onDocumentChanged(e)),
      vscode.workspace.onDidCloseTextDocument((d) => this.onDocumentClosed(d)),
      vscode.window.onDidChangeTextEditorSelection((e) => this.judge(e.textEditor)),
      vscode.window.onDidChangeActiveTextEditor((e) => this.onActiveEditorChanged(e)),
      vscode.workspace.onDidChangeConfiguration((e) => {
        if (e.affectsConfiguration("flywheel")) {
          this.loadSettings();
        }
      }),
    );
  }

  // --- completions -------------------------------------------------------------------------

  async provideInlineCompletionItems(
    document: vscode.TextDocument,
    position: vscode.Position,
    context: vscode.InlineCompletionContext,
    token: vscode.CancellationToken,
  ): Promise<vscode.InlineCompletionItem[]> {
    const settings = this.settings;
    // with the suggest widget open an inline item must extend its selection: not handled here
    if (settings === undefined || context.selectedCompletionInfo !== undefined) {
      return [];
    }
    const anchor = document.offsetAt(position);
    const prompt = document.getText(
      new vscode.Range(document.positionAt(Math.max(0, anchor - settings.promptChars)), position),
    );
    if (prompt.length === 0) {
      return [];
    }
    const abort = new AbortController();
    const cancelled = token.onCancellationRequested(() => abort.abort());
    let choices: readonly Choice[];
    let modelVersion: string | undefined;
    try {
      const completion = await complete({
        replicaUrl: settings.replicaUrl,
        apiKey: settings.replicaApiKey,
        model: settings.model,
        prompt,
        maxTokens: settings.maxTokens,
        temperature: settings.temperature,
        n: context.triggerKind === vscode.InlineCompletionTriggerKind.Invoke ? settings.choicesOnInvoke : 1,
        stop: settings.stop,
        sessionId: this.sessionId,
        timeoutMs: settings.requestTimeoutMs,
        signal: abort.signal,
      });
      choices = completion.choices.filter((c) => c.text.length > 0);
      modelVersion = completion.modelVersion;
    } catch (error) {
      if (!abort.signal.aborted) {
        this.log.warn(`completion request failed: ${String(error)}`);
      }
      return [];
    } finally {
      cancelled.dispose();
    }
    if (token.isCancellationRequested || choices.length === 0) {
      return []; // never shown: no offer, no feedback
    }
    const previous = this.offers.open(document.uri.toString());
    if (previous !== undefined) {
      this.sendPendingReject(previous); // a new request means no accept of it is on its way
    }
    const offer = this.offers.add(document.uri.toString(), anchor, choices, modelVersion);
    const at = new vscode.Range(position, position);
    return choices.map(
      (choice, i) =>
        new vscode.InlineCompletionItem(choice.text, at, {
          command: ACCEPTED_COMMAND,
          title: "Flywheel: record the accept",
          arguments: [offer.id, i],
        }),
    );
  }

  // --- accept and reject -------------------------------------------------------------------

  /** Runs after VS Code inserted choice `index` of offer `offerId`. */
  private onAccepted(offerId: number, index: number): void {
    const offer = this.offers.get(offerId);
    const choice = offer?.choices[index];
    if (offer === undefined || choice === undefined) {
      this.log.warn(`accept of an unknown suggestion (offer ${offerId}, choice ${index}): not reported`);
      return;
    }
    for (const [other, timer] of this.pendingRejects) {
      if (other.documentUri === offer.documentUri) {
        clearTimeout(timer);
        this.pendingRejects.delete(other);
        this.offers.settle(other, "passed");
        this.log.info(
          `reject of ${other.choices.map((c) => c.requestId).join(", ")} withdrawn: an accept followed`,
        );
      }
    }
    if (!this.offers.settle(offer, "accepted")) {
      this.log.warn(`accept of ${choice.requestId} after it was ${offer.state}: not reported`);
      return;
    }
    const ref = this.ref(offer, choice);
    this.feedback?.accept(ref);
    this.lastAccepted = ref;
    this.log.info(`accept ${choice.requestId}`);
    this.trackPersistence(offer, choice, ref);
  }

  /** Escape while a suggestion is visible (package.json keybinding): reject it, then hide it. */
  private async onDismiss(): Promise<void> {
    const editor = vscode.window.activeTextEditor;
    const offer = editor && this.offers.open(editor.document.uri.toString());
    if (offer !== undefined) {
      this.reject(offer, "dismissed with Escape");
    }
    await vscode.commands.executeCommand("editor.action.inlineSuggest.hide");
  }

  /** Decides the editor's open offer from the text between its anchor and the cursor. */
  private judge(editor: vscode.TextEditor): void {
    const document = editor.document;
    const offer = this.offers.open(document.uri.toString());
    if (offer === undefined || this.pendingRejects.has(offer)) {
      return; // a pending reject stands unless an accept withdraws it
    }
    const cursor = document.offsetAt(editor.selection.active);
    let typed: string | undefined;
    if (editor.selection.isEmpty && cursor >= offer.anchor) {
      const end = Math.min(cursor, offer.anchor + longestChoice(offer) + 1); // longer is off every choice
      typed = document.getText(new vscode.Range(document.positionAt(offer.anchor), document.positionAt(end)));
    }
    const decision = verdict(offer.choices, typed);
    if (decision === "reject") {
      this.reject(offer, typed === undefined ? "cursor moved away" : "overwritten");
    } else if (decision === "pass") {
      this.offers.settle(offer, "passed");
    }
  }

  private onActiveEditorChanged(editor: vscode.TextEditor | undefined): void {
    const active = editor?.document.uri.toString();
    for (const offer of this.offers.allOpen()) {
      if (offer.documentUri !== active) {
        this.reject(offer, "switched editor");
      }
    }
  }

  /** Rejects an open offer after REJECT_GRACE_MS, unless an accept in its document comes first. */
  private reject(offer: Offer, why: string): void {
    if (offer.state !== "open" || this.pendingRejects.has(offer)) {
      return;
    }
    this.log.info(`reject of ${offer.choices.map((c) => c.requestId).join(", ")} pending (${why})`);
    this.pendingRejects.set(
      offer,
      setTimeout(() => this.sendPendingReject(offer), REJECT_GRACE_MS),
    );
  }

  private sendPendingReject(offer: Offer): void {
    const timer = this.pendingRejects.get(offer);
    if (timer === undefined) {
      return;
    }
    clearTimeout(timer);
    this.pendingRejects.delete(offer);
    if (!this.offers.settle(offer, "rejected")) {
      return;
    }
    for (const choice of offer.choices) {
      this.feedback?.reject(this.ref(offer, choice));
      this.log.info(`reject ${choice.requestId}`);
    }
  }

  // --- edit persistence --------------------------------------------------------------------

  private trackPersistence(offer: Offer, choice: Choice, ref: SessionRef): void {
    const document = vscode.workspace.textDocuments.find((d) => d.uri.toString() === offer.documentUri);
    const delays = this.settings?.persistenceDelaysS ?? [];
    if (document === undefined || delays.length === 0) {
      return;
    }
    const span = insertedSpan(document, offer.anchor, choice.text);
    const acc: Accepted = {
      ref,
      documentUri: offer.documentUri,
      text: choice.text,
      span,
      acceptedAtMs: Date.now(),
      timers: [],
      measurementsLeft: delays.length,
    };
    for (const delayS of delays) {
      acc.timers.push(setTimeout(() => this.measure(acc, delayS), delayS * 1000));
    }
    this.accepted.add(acc);
  }

  /** Reports the share of `acc.text` still in its span, `afterS` seconds after the accept. */
  private measure(
    acc: Accepted,
    afterS: number,
    document = vscode.workspace.textDocuments.find((d) => d.uri.toString() === acc.documentUri),
  ): void {
    if (document === undefined || !this.accepted.has(acc)) {
      return; // closed: onDocumentClosed measured it
    }
    const window = document.getText(
      new vscode.Range(document.positionAt(acc.span.start), document.positionAt(acc.span.end)),
    );
    const fraction = persistedFraction(acc.text, window);
    this.feedback?.editPersistence({ ...acc.ref, fraction, afterS });
    this.log.info(`edit_persistence ${acc.ref.requestId}: ${fraction} after ${afterS} s`);
    acc.measurementsLeft -= 1;
    if (acc.measurementsLeft === 0) {
      this.accepted.delete(acc);
    }
  }

  /** Measures now (after_s = the time since the accept) and cancels the later checks. */
  private measureNow(acc: Accepted, document?: vscode.TextDocument): void {
    acc.timers.forEach(clearTimeout);
    const elapsedS = Math.max(0.001, Math.round(Date.now() - acc.acceptedAtMs) / 1000);
    this.measure(acc, elapsedS, document);
    this.accepted.delete(acc);
  }

  private onDocumentChanged(e: vscode.TextDocumentChangeEvent): void {
    const uri = e.document.uri.toString();
    // applied one after another in the order given, as VS Code's own document mirror does
    const edits: Edit[] = e.contentChanges.map((c) => ({
      start: c.rangeOffset,
      end: c.rangeOffset + c.rangeLength,
      insertedLength: c.text.length,
    }));
    for (const acc of this.accepted) {
      if (acc.documentUri === uri) {
        const max = maxSpanLength(acc.text.length);
        acc.span = edits.reduce((span, edit) => mapSpan(span, edit, max), acc.span);
      }
    }
    const offer = this.offers.open(uri);
    if (offer !== undefined) {
      offer.anchor = edits.reduce(moveAnchor, offer.anchor); // the verdict waits for the cursor
    }
  }

  private onDocumentClosed(document: vscode.TextDocument): void {
    const uri = document.uri.toString();
    for (const acc of this.accepted) {
      if (acc.documentUri === uri) {
        this.measureNow(acc, document); // it may already be gone from workspace.textDocuments
      }
    }
  }

  // --- ratings, settings, lifecycle --------------------------------------------------------

  private rate(value: 1 | -1): void {
    if (this.lastAccepted === undefined) {
      void vscode.window.showInformationMessage("Flywheel: no accepted suggestion to rate yet.");
      return;
    }
    this.feedback?.rating({ ...this.lastAccepted, value });
    this.log.info(`rating ${value} for ${this.lastAccepted.requestId}`);
    vscode.window.setStatusBarMessage(`Flywheel: rated ${value > 0 ? "👍" : "👎"}`, 3000);
  }

  private ref(offer: Offer, choice: Choice): SessionRef {
    const ref: SessionRef = { requestId: choice.requestId, sessionId: this.sessionId };
    if (offer.modelVersion !== undefined) {
      ref.modelVersion = offer.modelVersion;
    }
    return ref;
  }

  private loadSettings(): void {
    const previous = this.settings;
    try {
      this.settings = readSettings(vscode.workspace.getConfiguration("flywheel"));
    } catch (error) {
      this.settings = undefined;
      this.log.error(String(error));
      void vscode.window.showErrorMessage(`${String(error)}. No completions until this is fixed.`);
      return;
    }
    const s = this.settings;
    if (previous?.ingestUrl === s.ingestUrl && previous.ingestApiKey === s.ingestApiKey && this.feedback) {
      return;
    }
    const old = this.feedback;
    this.feedback = undefined;
    void old?.dispose().catch((e: unknown) => this.log.error(`feedback client: ${String(e)}`));
    if (s.ingestApiKey === "") {
      this.log.warn("flywheel.ingestApiKey is empty: feedback is not sent");
      return;
    }
    this.feedback = new FeedbackClient({
      baseUrl: s.ingestUrl,
      apiKey: s.ingestApiKey,
      onError: (e: DeliveryError) =>
        this.log.error(
          `feedback ${e.kind} (${e.events.length} events, status ${e.status ?? "-"}): ${e.message}`,
        ),
    });
  }

  /**
   * Sends the pending rejects, takes every pending persistence measurement, then flushes and
   * closes the feedback client (VS Code awaits this through `deactivate`).
   */
  dispose(): Promise<void> {
    this.disposed ??= (async () => {
      for (const offer of [...this.pendingRejects.keys()]) {
        this.sendPendingReject(offer);
      }
      for (const acc of [...this.accepted]) {
        this.measureNow(acc);
      }
      const feedback = this.feedback;
      this.feedback = undefined;
      this.disposables.forEach((d) => d.dispose());
      await feedback?.dispose();
    })();
    return this.disposed;
  }
}

/** Where the accept put `text`: just before the cursor if it is there, else at the offer's anchor. */
function insertedSpan(document: vscode.TextDocument, anchor: number, text: string): Span {
  const editor = vscode.window.visibleTextEditors.find((e) => e.document === document);
  if (editor !== undefined) {
    const end = document.offsetAt(editor.selection.active);
    const start = end - text.length;
    if (
      start >= 0 &&
      document.getText(new vscode.Range(document.positionAt(start), editor.selection.active)) === text
    ) {
      return { start, end };
    }
  }
  return { start: anchor, end: Math.min(anchor + text.length, document.getText().length) };
}

/**
 * An offer's anchor after `edit`: shifted by edits before it, pulled back by one that removed it.
 * Text inserted right at the anchor is typed into the suggestion: the anchor stays.
 */
function moveAnchor(anchor: number, edit: Edit): number {
  if (edit.end < anchor || (edit.end === anchor && edit.start < anchor)) {
    return anchor + edit.insertedLength - (edit.end - edit.start);
  }
  return Math.min(anchor, edit.start);
}
