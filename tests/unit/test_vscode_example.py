"""examples/vscode-extension type-checks against `@types/vscode` and the TypeScript feedback client.

The extension is not run here (that needs a VS Code extension host). `npm run typecheck` checks
it with strict tsc against the client's source (clients/typescript/src, through the tsconfig's
`paths`); a copy with a wrong call to the client must fail that check, so the check is not
vacuous. `npm test` runs the example's Node tests of its pure parts (the edit-persistence
measure, the reject heuristic, the response parser). node_modules come from `make node`
(`npm ci` from the committed lockfile); without them these tests fail and say so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "vscode-extension"
CLIENT_SOURCE = REPO / "clients" / "typescript" / "src" / "index.ts"
TIMEOUT_S = 300  # a generous bound on one tsc or npm run; they take seconds


@pytest.fixture(scope="module")
def tsc() -> Path:
    binary = EXAMPLE / "node_modules" / ".bin" / "tsc"
    if not binary.exists() or not (EXAMPLE / "node_modules" / "@types" / "vscode").is_dir():
        pytest.fail(
            f"{EXAMPLE.relative_to(REPO)}/node_modules is not installed: run `make node` "
            "(npm ci from the committed package-lock.json)"
        )
    if not CLIENT_SOURCE.exists():
        pytest.fail(
            f"{CLIENT_SOURCE.relative_to(REPO)} is missing: the example imports the client from it"
        )
    return binary


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )


def test_example_typechecks_against_vscode_and_the_client(tsc: Path):
    result = _run(["npm", "run", "--silent", "typecheck"], EXAMPLE)
    assert result.returncode == 0, f"tsc failed:\n{result.stdout}\n{result.stderr}"


def test_typecheck_fails_on_a_wrong_call_to_the_client(tsc: Path, tmp_path: Path):
    """The same check on a copy of src/: it passes as is, and fails once a call is wrong."""
    shutil.copytree(EXAMPLE / "src", tmp_path / "src")
    (tmp_path / "tsconfig.json").write_text(
        json.dumps(
            {
                # `paths` stay relative to the example's tsconfig, so the copy sees the same client
                "extends": str(EXAMPLE / "tsconfig.json"),
                "compilerOptions": {"typeRoots": [str(EXAMPLE / "node_modules" / "@types")]},
                "include": ["src"],
            }
        )
    )
    as_is = _run([str(tsc), "-p", str(tmp_path / "tsconfig.json")], tmp_path)
    assert as_is.returncode == 0, f"the unmodified copy does not type-check:\n{as_is.stdout}"

    extension = tmp_path / "src" / "extension.ts"
    right = "this.feedback?.editPersistence({ ...acc.ref, fraction, afterS });"
    source = extension.read_text()
    assert right in source, "the example no longer reports persistence this way; update this test"
    # the wire name instead of the client's camelCase option
    extension.write_text(source.replace(right, right.replace("afterS", "after_s: afterS")))
    wrong = _run([str(tsc), "-p", str(tmp_path / "tsconfig.json")], tmp_path)
    assert wrong.returncode != 0, "tsc accepted editPersistence({after_s}); the check is vacuous"
    assert "extension.ts" in wrong.stdout and "after_s" in wrong.stdout, wrong.stdout


def test_example_node_tests_pass(tsc: Path):
    result = _run(["npm", "test", "--silent"], EXAMPLE)
    assert result.returncode == 0, f"npm test failed:\n{result.stdout}\n{result.stderr}"
    assert "# fail 0" in result.stdout, result.stdout
