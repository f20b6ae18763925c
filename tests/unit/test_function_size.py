"""No function in the repository is longer than `MAX_LINES` (docs/DESIGN.md, "Layering"):
a function that long holds several steps that deserve names, and it is where a change lands
without anyone seeing what else it touches. The tests count too."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 150


def _python_files() -> list[Path]:
    """The repository's tracked and new (not ignored) .py files."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [REPO / line for line in out.splitlines() if (REPO / line).is_file()]


def function_lengths(path: Path, root: Path = REPO) -> list[tuple[int, str]]:
    """(lines, "path:line name") of every function and method in `path` (named relative to
    `root`), nested ones too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(root)
    return [
        (node.end_lineno - node.lineno + 1, f"{rel}:{node.lineno} {node.name}")
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def test_the_scan_sees_the_repository_and_measures_nested_functions(tmp_path):
    files = _python_files()
    assert len(files) > 300 and REPO / "app" / "run.py" in files, len(files)
    src = tmp_path / "probe.py"
    body = "".join(f"        x = {i}\n" for i in range(5))
    src.write_text(f"def outer():\n    def inner():\n{body}        return x\n    return inner\n")
    lengths = {name.split(" ")[1]: n for n, name in function_lengths(src, tmp_path)}
    assert lengths == {"outer": 9, "inner": 7}, lengths


def test_no_function_is_longer_than_the_limit():
    too_long = sorted(
        (entry for path in _python_files() for entry in function_lengths(path)),
        reverse=True,
    )
    too_long = [f"{n} lines: {where}" for n, where in too_long if n > MAX_LINES]
    assert not too_long, f"functions over {MAX_LINES} lines:\n" + "\n".join(too_long)
