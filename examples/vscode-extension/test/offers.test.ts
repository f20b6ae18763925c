/**
 * The reject heuristic (src/offers.ts) and the completion response parser (src/replica.ts).
 */
import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { OfferBook, verdict } from "../src/offers";
import { parseCompletion, ReplicaError } from "../src/replica";

const choices = [
  { requestId: "r1", text: "foo(bar)" },
  { requestId: "r2", text: "fizz()" },
];

describe("verdict", () => {
  it("keeps an offer the user is typing along", () => {
    assert.equal(verdict(choices, ""), "keep");
    assert.equal(verdict(choices, "fo"), "keep");
    assert.equal(verdict(choices, "fi"), "keep");
    assert.equal(verdict(choices, "foo(bar)"), "keep"); // the accept inserts the whole choice
  });

  it("rejects an offer that was overwritten or left", () => {
    assert.equal(verdict(choices, "x"), "reject");
    assert.equal(verdict(choices, "foo(baz"), "reject");
    assert.equal(verdict(choices, undefined), "reject");
  });

  it("passes an offer the user typed out and went past", () => {
    assert.equal(verdict(choices, "foo(bar);"), "pass");
  });
});

describe("OfferBook", () => {
  it("passes the open offer of a document when a new one is shown there", () => {
    const book = new OfferBook();
    const first = book.add("file:///a", 3, choices, "7");
    const other = book.add("file:///b", 0, choices, "7");
    const second = book.add("file:///a", 4, choices, "7");
    assert.equal(first.state, "passed");
    assert.equal(book.open("file:///a"), second);
    assert.deepEqual(book.allOpen(), [other, second]);
    // a passed offer can still be accepted, once; a decided one cannot change
    assert.equal(book.settle(first, "accepted"), true);
    assert.equal(book.settle(first, "rejected"), false);
    assert.equal(book.settle(second, "rejected"), true);
    assert.equal(book.settle(second, "accepted"), false);
    assert.equal(book.open("file:///a"), undefined);
  });

  it("forgets the oldest offers beyond its capacity", () => {
    const book = new OfferBook(2);
    const ids = [1, 2, 3].map((i) => book.add(`file:///${i}`, 0, choices, undefined).id);
    assert.equal(book.get(ids[0]!), undefined);
    assert.ok(book.get(ids[2]!));
  });
});

describe("parseCompletion", () => {
  it("keys a single choice by the response id and takes the version header", () => {
    const body = {
      id: "req-1",
      choices: [{ index: 0, text: "x", finish_reason: "stop" }],
      system_fingerprint: "flywheel-v6",
    };
    assert.deepEqual(parseCompletion(body, 1, "7"), {
      choices: [{ requestId: "req-1", text: "x" }],
      modelVersion: "7",
    });
    assert.equal(parseCompletion(body, 1, null).modelVersion, "6");
  });

  it("keys each of n choices by its own request_id, in index order", () => {
    const body = {
      id: "req-1",
      choices: [
        { index: 1, text: "b", request_id: "req-1b" },
        { index: 0, text: "a", request_id: "req-1a" },
      ],
    };
    assert.deepEqual(
      parseCompletion(body, 2, null).choices.map((c) => c.requestId),
      ["req-1a", "req-1b"],
    );
  });

  it("refuses a response it cannot key feedback by", () => {
    assert.throws(() => parseCompletion({ choices: [] }, 1, null), ReplicaError);
    assert.throws(
      () =>
        parseCompletion(
          {
            id: "r",
            choices: [
              { index: 0, text: "a" },
              { index: 1, text: "b" },
            ],
          },
          2,
          null,
        ),
      /request_id/,
    );
    assert.throws(() => parseCompletion({ id: "r", choices: [] }, 1, null), /asked for 1/);
  });
});
