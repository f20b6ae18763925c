"""Every package of the layout carries a card: its `__init__` docstring says what it owns, what it
may import, where its tests and its docs are. The card is checked against the tree, so it cannot
go stale: the paths it names exist, the modules it names exist in the package, and the package
imports nothing of the project beyond its `May import:` line (top-level and deferred imports
alike). The import contracts (pyproject.toml, import-linter) state the layering as a rule; the
cards state each package's own share of it where a reader opens the package.

A card's last lines:

    May import: app.contracts, app.infra, app.settings, kernels, policy
    Tests: tests/unit/replica/, tests/integration/replica/
    Docs: docs/REPLICA.md
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# the packages that carry a card: each role, each shared layer, the command line
PACKAGES = (
    "app.api",
    "app.cli",
    "app.contracts",
    "app.controller",
    "app.db",
    "app.infra",
    "app.projector",
    "app.registry",
    "app.replica",
    "app.report",
    "app.sandbox",
    "app.simulate",
    "streams",
    "trainer",
    "policy",
    "kernels",
)
# what a `May import:` line may name: the packages above and app's single modules
UNITS = PACKAGES + (
    "app.settings",
    "app.httplimits",
    "app.edits",
    "app.client",
    "app.config_reference",
    "app.run",
    "app.supervisor",
    "app.status_view",
)
ALIASES = {"app.settings_base": "app.settings"}  # the settings' base class, part of them
FIELDS = ("May import:", "Tests:", "Docs:")


def _unit(module: str) -> str | None:
    module = next(
        (u for a, u in ALIASES.items() if module == a or module.startswith(a + ".")), module
    )
    found = [u for u in UNITS if module == u or module.startswith(u + ".")]
    return max(found, key=len) if found else None


def _package_dir(package: str) -> Path:
    return REPO.joinpath(*package.split("."))


def _card(package: str) -> dict[str, list[str] | str]:
    """The card of `package`: its docstring (`text`) and each field's comma-separated items."""
    init = _package_dir(package) / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text()))
    assert doc, f"{init.relative_to(REPO)} has no docstring: a package card is its docstring"
    card: dict[str, list[str] | str] = {"text": doc}
    for field in FIELDS:
        lines = [ln for ln in doc.splitlines() if ln.startswith(field)]
        assert len(lines) == 1, f"{init.relative_to(REPO)}: the card needs one '{field}' line"
        items = lines[0].removeprefix(field).strip()
        card[field] = [] if items in ("", "nothing") else [i.strip() for i in items.split(",")]
    return card


def _imports(package: str) -> dict[str, set[str]]:
    """The project units the package's modules import (any depth, deferred ones too) -> the
    modules of the package that import each."""
    out: dict[str, set[str]] = {}
    root = _package_dir(package)
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                unit = _unit(name)
                if unit is not None and unit != package:
                    out.setdefault(unit, set()).add(str(path.relative_to(REPO)))
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_the_card_names_what_the_package_may_import_and_it_imports_nothing_else(package):
    allowed = _card(package)["May import:"]
    unknown = [u for u in allowed if u not in UNITS]
    assert not unknown, f"{package}'s card names {unknown}, which are not packages of the layout"
    beyond = {u: sorted(where) for u, where in _imports(package).items() if u not in allowed}
    assert not beyond, (
        f"{package} imports what its card does not allow (add it to the card's 'May import:' "
        f"line if the layering allows it, docs/DESIGN.md 'Layering'): {beyond}"
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_the_paths_and_modules_a_card_names_exist(package):
    card = _card(package)
    for field in ("Tests:", "Docs:"):
        assert card[field], f"{package}'s card names no {field.lower().rstrip(':')}"
        missing = [p for p in card[field] if not (REPO / p).exists()]
        assert not missing, f"{package}'s card names {field} {missing}, which do not exist"
    root = _package_dir(package)
    # `name.py` and `sub/name.py` in the card are the package's own modules; a path from the
    # repository's root (`app/contracts/aliases.py`) names another package's
    named = set(re.findall(r"`((?:[a-z_]+/)*[a-z_0-9]+\.py)`", str(card["text"])))
    missing = sorted(n for n in named if not (root / n).exists() and not (REPO / n).exists())
    assert not missing, f"{package}'s card names modules it does not have: {missing}"


def test_every_package_of_the_layout_has_a_card():
    """A new package directly under app/ (or a new top-level one) gets a card too."""
    top = {p.name for p in REPO.iterdir() if (p / "__init__.py").exists()}
    under_app = {f"app.{p.name}" for p in (REPO / "app").iterdir() if (p / "__init__.py").exists()}
    expected = (top - {"app", "tests", "bench"}) | under_app
    assert expected == set(PACKAGES), (
        f"packages without a card: {sorted(expected - set(PACKAGES))}; "
        f"cards of packages that are gone: {sorted(set(PACKAGES) - expected)}"
    )
