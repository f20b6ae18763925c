"""The agent tasks and their sandbox: real files, real edits, the tests run in a subprocess."""

from __future__ import annotations

import json

import pytest

from app.sandbox.sandbox import TOOL_NAMES, TOOLS, Sandbox
from app.sandbox.tasks import OPS, STUB, apply_op, body, tasks


def _edit(box: Sandbox, path: str, old: str, new: str):
    return box.call("apply_edit", json.dumps({"path": path, "old": old, "new": new}))


def test_tasks_are_reproducible_and_held_out_tasks_use_other_repositories():
    assert tasks(20, seed=3) == tasks(20, seed=3)
    assert tasks(20, seed=3) != tasks(20, seed=4)
    train = {t.function.split("_", 1)[1] for t in tasks(200, seed=0)}
    held = {t.function.split("_", 1)[1] for t in tasks(200, seed=0, held_out=True)}
    assert train and held and not train & held
    for t in tasks(200, seed=1):
        assert t.op == OPS[t.verb] and t.instruction == f"implement {t.function} in calc.py"
        assert t.files()[t.source_path] == f"def {t.function}(a, b):\n    {STUB}\n"
        # the pairs tell every operator apart, so only the right one passes
        for a, b in (t.visible, *t.hidden):
            assert len({apply_op(op, a, b) for op in OPS.values()}) == len(OPS)


def test_the_implementation_passes_the_visible_and_hidden_tests_and_a_wrong_one_neither():
    task = tasks(1, seed=5)[0]
    with Sandbox(task) as box:
        assert (
            box.call("read_file", json.dumps({"path": task.source_path})).content
            == (task.files()[task.source_path])
        )
        assert box.call("run_tests", "{}").content == "FAILED: NotImplementedError"
        assert box.hidden_pass() is False
        wrong = next(op for op in OPS.values() if op != task.op)
        assert _edit(box, task.source_path, STUB, body(wrong)).error is None
        assert box.run_tests() == (False, "FAILED: AssertionError") and not box.hidden_pass()
        assert task.the_fix() == (STUB, body(task.op))
        assert _edit(box, task.source_path, f"a {wrong} b", f"a {task.op} b").content == (
            f"edited {task.source_path}"
        )
        assert box.call("run_tests", "{}").content == "passed"
        assert box.hidden_pass() and not box.tests_edited()


def test_weakening_the_test_file_passes_it_but_not_the_hidden_tests():
    task = tasks(1, seed=6)[0]
    with Sandbox(task) as box:
        _edit(box, task.test_path, "assert", "assert True or")
        assert box.run_tests() == (True, "passed")
        assert box.tests_edited() and not box.hidden_pass()


@pytest.mark.parametrize(
    "name, arguments, error",
    [
        ("read_file", '{"path": "../etc/passwd"}', "no file '../etc/passwd'"),
        ("read_file", "{}", "no file None"),
        ("apply_edit", '{"path": "%s", "old": "zzz", "new": "y"}', "'zzz' is not in"),
        ("apply_edit", '{"path": "%s", "old": "", "new": "y"}', "non-empty string `old`"),
        ("delete_file", "{}", "unknown tool 'delete_file'"),
        ("read_file", "{not json", "arguments are not JSON"),
        ("read_file", "[1]", "must be a JSON object"),
    ],
)
def test_a_call_that_cannot_be_done_is_an_error_and_changes_nothing(name, arguments, error):
    task = tasks(1, seed=7)[0]
    with Sandbox(task) as box:
        result = box.call(name, arguments.replace("%s", task.source_path))
        assert result.error is not None and error in result.error, result
        assert result.content.startswith("error: ")
        for path, text in task.files().items():
            assert (box.root / path).read_text() == text
        assert box.edited == []


def test_the_tools_are_openai_function_tools():
    assert TOOL_NAMES == ("read_file", "apply_edit", "run_tests")
    for tool in TOOLS:
        assert tool["type"] == "function"
        assert tool["function"]["parameters"]["type"] == "object"


def test_the_sandbox_is_gone_after_the_session():
    task = tasks(1, seed=8)[0]
    with Sandbox(task) as box:
        root = box.root
        assert (root / task.source_path).exists()
    assert not root.exists()
