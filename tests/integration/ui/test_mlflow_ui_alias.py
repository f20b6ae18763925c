"""Moving an alias in the real MLflow UI (headless Debian Chromium driven by Playwright) moves
it in the registry, the way an operator promotes or rolls back (docs/DESIGN.md §Registry
and artifacts).

    deploy/chromium/ensure.sh && .venv/bin/pytest tests/integration/ui -q
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException

from tests.browser import MlflowUi, move_alias_in_ui

pytestmark = pytest.mark.integration
log = logging.getLogger(__name__)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > len(PNG_MAGIC) and data.startswith(PNG_MAGIC), (
        f"{path} is not a non-empty PNG ({len(data)} bytes)"
    )


def test_moving_champion_in_the_ui_reassigns_it_in_the_registry(
    mlflow_server, ui_model, tmp_path: Path
):
    client, name = ui_model.client, ui_model.name
    client.set_registered_model_alias(name, "champion", "1")
    # another alias on the target version: the UI edit must add champion, not replace candidate
    client.set_registered_model_alias(name, "candidate", "3")

    shots = tmp_path / "screenshots"
    to_v3 = move_alias_in_ui(mlflow_server.uri, name, "champion", 3, screenshot_dir=shots)
    assert (to_v3.from_version, to_v3.version, to_v3.changed) == ("1", "3", True), to_v3
    assert client.get_registered_model(name).aliases == {"champion": "3", "candidate": "3"}

    to_v2 = move_alias_in_ui(mlflow_server.uri, name, "champion", "2", screenshot_dir=shots)
    assert (to_v2.from_version, to_v2.version, to_v2.changed) == ("3", "2", True), to_v2
    assert client.get_registered_model(name).aliases == {"champion": "2", "candidate": "3"}

    final = to_v2.screenshots[-1]
    assert final.parent == shots and final.name.endswith("champion-v2-3-saved.png"), (
        to_v2.screenshots
    )
    assert_png(final)
    log.info(
        "UI moves: v1->v3 %.2fs, v3->v2 %.2fs (page open -> alias shown)",
        to_v3.seconds,
        to_v2.seconds,
    )


def test_one_browser_moves_an_unheld_alias_leaves_a_placed_one_and_refuses_a_missing_version(
    mlflow_server, ui_model, tmp_path: Path
):
    client, name = ui_model.client, ui_model.name
    with MlflowUi(mlflow_server.uri, screenshot_dir=tmp_path) as ui:
        first = ui.move_alias(
            name, "candidate", 2
        )  # nobody holds it: the "Add" path, no reassignment notice
        assert (first.from_version, first.changed) == (None, True), first
        assert client.get_registered_model(name).aliases == {"candidate": "2"}

        again = ui.move_alias(name, "candidate", 2)  # already there: nothing to save
        assert (again.from_version, again.changed) == ("2", False), again

        back = ui.move_alias(name, "candidate", 1)
        assert (back.from_version, back.changed) == ("2", True), back

        with pytest.raises(
            MlflowException, match="not found|does not exist|RESOURCE_DOES_NOT_EXIST"
        ):
            ui.move_alias(name, "candidate", 4)  # no such version: refused before the UI is touched
    assert client.get_registered_model(name).aliases == {"candidate": "1"}
    log.info(
        "one browser: %.2fs, %.2fs, %.2fs per move", first.seconds, again.seconds, back.seconds
    )


def test_an_alias_the_ui_would_rewrite_or_a_bad_version_is_refused_before_chromium_starts():
    # no server on this port: the arguments are refused before anything is contacted or launched
    with pytest.raises(ValueError, match="lower-case"):
        move_alias_in_ui("http://127.0.0.1:9", "m", "Champion!", 2)
    with pytest.raises(ValueError, match="version 'latest'"):
        move_alias_in_ui("http://127.0.0.1:9", "m", "champion", "latest")
