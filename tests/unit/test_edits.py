"""One definition of a valid edit, shared by the simulated users and the gate's monitors."""

from __future__ import annotations

from app.edits import balanced, classify, is_no_edit, is_valid


def test_classify_each_kind():
    assert classify("return a + b\n") == "edit"
    assert (
        classify("return f(x") == "broken"
        and classify("s = 'abc") == "broken"
        and classify("x = ]") == "broken"
    )
    assert classify("# which bound is inclusive?\n   # lo or hi?") == "no_edit"
    assert classify("  \n ") == "empty"
    assert classify("# a remark\nreturn x") == "edit", "a comment above code is an edit"


def test_comments_are_not_code_for_the_bracket_balance():
    assert balanced("return x  # it's (fine") and balanced("# don't know?")
    assert balanced("s = '#('") and not balanced("s = '#("), "a # inside a string is not a comment"


def test_rates_the_gate_counts():
    assert not is_valid("return f(x") and is_valid("") and is_valid("# why?")
    assert (
        is_no_edit("")
        and is_no_edit("# why?")
        and not is_no_edit("return x")
        and not is_no_edit("return f(x")
    )


def test_a_lone_docstring_is_no_edit_and_a_truncated_one_is_broken():
    assert classify('"""Clamp value to the range [lo, hi]."""\n    ') == "no_edit"
    assert classify('"""Return the count of keys."""\n    # which keys?') == "no_edit"
    assert classify('"""Return the total of numbers whe') == "broken", (
        "cut off inside the docstring: won't parse"
    )
    assert classify('"""Return the total."""\n    return sum(xs)') == "edit"
