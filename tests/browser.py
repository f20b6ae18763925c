"""Drive the real MLflow UI in a real headless Chromium to move a registered model's alias, the
way an operator does (docs/DESIGN.md §Registry and artifacts: moving `champion` or `candidate` in the
MLflow UI is an instruction the controller carries out).

Why a browser and not `set_registered_model_alias`: the end-to-end tests must be able to say
"moved in the UI" — the request then comes from MLflow's own React app (its alias editor calls
the registry's alias endpoints), which is exactly what the controller's webhook receiver and
polling reconciler see in production.

How: Playwright's sync API launches Debian's `/usr/bin/chromium` (installed by
`deploy/chromium/ensure.sh`; `playwright install` is never used) with a fresh user-data-dir,
opens `#/models/<name>/versions/<v>`, clicks the alias editor ("Add aliases" / "Edit aliases"),
types the alias into the editor's combobox, presses Enter, waits for the reassignment notice
when another version holds the alias, clicks "Save aliases", waits for the dialog to close and
for the alias tag to show on the version page, and finally reads
`MlflowClient().get_registered_model(name).aliases` to check the registry agrees (not
`search_model_versions`, whose `aliases` are empty).

    from tests.browser import move_alias_in_ui, MlflowUi
    move_alias_in_ui(mlflow_server.uri, "flywheel-policy", "champion", 3, screenshot_dir=tmp_path)
    with MlflowUi(mlflow_server.uri) as ui:          # one Chromium for several moves
        ui.move_alias("flywheel-policy", "champion", 2)

Its test: `.venv/bin/pytest tests/integration/ui -q`.
"""

from __future__ import annotations

import logging
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

log = logging.getLogger(__name__)

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# MLflow's alias editor lower-cases the typed text and drops everything but [A-Za-z0-9_-]; an
# alias outside this pattern would silently become a different alias, so refuse it up front.
ALIAS_RE = re.compile(r"^[a-z0-9_-]{1,255}$")


@dataclass
class AliasMove:
    """What one UI alias move did."""

    model: str
    alias: str
    version: str  # the version that holds the alias now (checked in the registry)
    from_version: (
        str | None
    )  # who held it before (registry, read just before the move); None: nobody
    changed: bool  # False when the version already held the alias (nothing to save)
    seconds: float  # page open -> UI shows the alias on the version
    load_seconds: float  # page open -> the version page and its alias editor are shown
    screenshots: list[Path] = field(default_factory=list)


def check_move(alias: str, version: int | str) -> str:
    """Validate an alias move's arguments before any browser starts; returns the version as MLflow
    writes it ("3")."""
    if not ALIAS_RE.match(alias):
        raise ValueError(
            f"alias {alias!r}: the MLflow UI only keeps lower-case letters, digits, '_' and '-' "
            "(it would silently save a different alias)"
        )
    if not str(version).isdigit() or int(version) < 1:
        raise ValueError(
            f"version {version!r}: expected a registered model version number such as 3"
        )
    return str(int(version))


class MlflowUi:
    """One headless Chromium (fresh profile) on an MLflow server's UI; `move_alias` per move.

    timeout_s bounds every single wait (page load, clicks, dialog, tags; Playwright `expect` gets it
    explicitly, its own default is 5 s); it is generous because
    the test machine is shared and heavily loaded. No sleeps: every step waits on UI state.
    """

    def __init__(
        self,
        mlflow_uri: str,
        *,
        screenshot_dir: Path | str | None = None,
        timeout_s: float = 120.0,
        chromium: Path | str = CHROMIUM,
    ):
        assert timeout_s > 0, f"timeout_s must be positive, got {timeout_s}"
        self.mlflow_uri = mlflow_uri.rstrip("/")
        self.screenshot_dir = Path(screenshot_dir) if screenshot_dir is not None else None
        self.timeout_ms = float(timeout_s) * 1000.0
        self.chromium = Path(chromium)
        self._pw = self._context = self._profile = None
        self._shots = 0

    # ---- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> MlflowUi:
        from playwright.sync_api import sync_playwright

        if not self.chromium.is_file():
            raise FileNotFoundError(
                f"{self.chromium} is missing: run deploy/chromium/ensure.sh "
                "(installs Debian's chromium; `playwright install` is not used)"
            )
        if self.screenshot_dir is not None:
            self.screenshot_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        self._profile = tempfile.TemporaryDirectory(prefix="flywheel-chromium-")
        self._pw = sync_playwright().start()
        try:
            self._context = self._pw.chromium.launch_persistent_context(
                self._profile.name,
                executable_path=str(self.chromium),
                headless=True,
                args=CHROMIUM_ARGS,
                viewport={"width": 1400, "height": 900},
                locale="en-US",
                timeout=self.timeout_ms,
            )
            self._context.set_default_timeout(self.timeout_ms)
            self._context.set_default_navigation_timeout(self.timeout_ms)
        except BaseException:
            self.close()
            raise
        log.info("chromium up in %.2fs (%s)", time.monotonic() - t0, self.chromium)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._context is not None:
            self._context.close()
            self._context = None
        if self._pw is not None:
            self._pw.stop()
            self._pw = None
        if self._profile is not None:
            self._profile.cleanup()
            self._profile = None

    # ---- the operator's move ---------------------------------------------------------------
    def version_url(self, model_name: str, version: int | str) -> str:
        return f"{self.mlflow_uri}/#/models/{quote(model_name, safe='')}/versions/{version}"

    def move_alias(self, model_name: str, alias: str, version: int | str) -> AliasMove:
        """Give `alias` to `version` in the UI (taking it from whichever version held it);
        return once the version page shows it and the registry agrees."""
        from mlflow import MlflowClient
        from playwright.sync_api import Error as PlaywrightError
        from playwright.sync_api import expect

        assert self._context is not None, (
            "use MlflowUi as a context manager (with MlflowUi(uri) as ui: ...)"
        )
        version = check_move(alias, version)
        client = MlflowClient(tracking_uri=self.mlflow_uri, registry_uri=self.mlflow_uri)
        from_version = client.get_registered_model(model_name).aliases.get(alias)
        client.get_model_version(
            model_name, version
        )  # a missing version fails here, not after a UI timeout

        shots: list[Path | None] = []
        page = self._context.new_page()
        t0 = time.monotonic()
        try:
            page.goto(self.version_url(model_name, version), wait_until="domcontentloaded")
            # The "Aliases:" row of the version's details; its button is "Add" (title "Add aliases")
            # while the version has none, a pencil (title "Edit aliases") once it has some; each
            # alias is a tag whose title is the alias name.
            row = page.get_by_test_id("descriptions-item").filter(
                has=page.get_by_test_id("descriptions-item-label").get_by_text(
                    "Aliases", exact=True
                )
            )
            editor = row.get_by_title("Add aliases", exact=True).or_(
                row.get_by_title("Edit aliases", exact=True)
            )
            heading = page.get_by_role("heading", name=f"Version {version}", exact=True)
            expect(heading).to_be_visible(timeout=self.timeout_ms)
            expect(editor).to_be_visible(timeout=self.timeout_ms)
            load_seconds = time.monotonic() - t0
            shots.append(self._shot(page, f"{alias}-v{version}-1-page"))
            tag = row.get_by_title(alias, exact=True)
            if tag.count() > 0:
                log.info("%s@%s already on version %s; nothing to save", model_name, alias, version)
                changed = False
            else:
                self._edit_in_dialog(page, editor, alias, version, from_version, shots)
                changed = True
            expect(tag).to_be_visible(
                timeout=self.timeout_ms
            )  # the page re-fetched the version after the save
            seconds = time.monotonic() - t0
            shots.append(self._shot(page, f"{alias}-v{version}-3-saved"))
        except (PlaywrightError, AssertionError):
            try:  # what the page showed when it failed; never hides the original error
                self._shot(page, f"{alias}-v{version}-failed")
            except PlaywrightError as shot_error:
                log.warning("no failure screenshot: %s", shot_error)
            raise
        finally:
            page.close()

        now = client.get_registered_model(model_name).aliases
        assert now.get(alias) == version, (
            f"the UI shows {alias} on version {version} but the registry says {model_name} aliases = {now}"
        )
        log.info(
            "moved %s@%s %s -> %s in the MLflow UI in %.2fs (page load %.2fs)",
            model_name,
            alias,
            from_version,
            version,
            seconds,
            load_seconds,
        )
        return AliasMove(
            model=model_name,
            alias=alias,
            version=version,
            from_version=from_version,
            changed=changed,
            seconds=seconds,
            load_seconds=load_seconds,
            screenshots=[s for s in shots if s is not None],
        )

    def _edit_in_dialog(
        self,
        page,
        editor,
        alias: str,
        version: str,
        from_version: str | None,
        shots: list[Path | None],
    ) -> None:
        from playwright.sync_api import expect

        editor.click()
        dialog = page.get_by_role("dialog").filter(
            has=page.get_by_role(
                "heading", name=f"Add/Edit alias for model version {version}", exact=True
            )
        )
        expect(dialog).to_be_visible(timeout=self.timeout_ms)
        box = dialog.get_by_role("combobox")
        box.click()
        box.fill(alias)
        box.press("Enter")  # the editor is a tags select: Enter turns the typed text into a tag
        # the draft tag is exactly the typed alias (not a longer existing alias it is a prefix of)
        expect(dialog.get_by_title(alias, exact=True)).to_be_visible(timeout=self.timeout_ms)
        save = dialog.get_by_role("button", name="Save aliases")
        # enabled only once the draft differs from the version's aliases
        expect(save).to_be_enabled(timeout=self.timeout_ms)
        # When another version holds the alias, MLflow warns that saving takes it from there.
        if from_version is not None and from_version != version:
            notice = dialog.get_by_role("alert").filter(
                has_text=f'The "{alias}" alias is also being used on version {from_version}.'
            )
            expect(notice).to_be_visible(timeout=self.timeout_ms)
            log.info("UI notice: %s", notice.inner_text())
        shots.append(self._shot(page, f"{alias}-v{version}-2-dialog"))
        save.click()
        try:
            expect(dialog).to_be_hidden(timeout=self.timeout_ms)
        except AssertionError as e:
            alerts = dialog.get_by_role("alert").all_inner_texts()
            raise AssertionError(
                f"the alias dialog did not close after 'Save aliases'; its alerts: {alerts}"
            ) from e

    def _shot(self, page, name: str) -> Path | None:
        if self.screenshot_dir is None:
            return None
        self._shots += 1
        path = self.screenshot_dir / f"{self._shots:02d}-{name}.png"
        page.screenshot(path=str(path))
        return path


def move_alias_in_ui(
    mlflow_uri: str,
    model_name: str,
    alias: str,
    version: int | str,
    screenshot_dir: Path | str | None = None,
    *,
    timeout_s: float = 120.0,
) -> AliasMove:
    """Start Chromium, move `alias` of `model_name` to `version` in the MLflow UI, close Chromium.

    Returns only after the version page shows the alias and
    `MlflowClient().get_registered_model(model_name).aliases[alias] == str(version)`.
    Screenshots of each step (and of a failure) go to `screenshot_dir` when given.
    """
    check_move(alias, version)
    with MlflowUi(mlflow_uri, screenshot_dir=screenshot_dir, timeout_s=timeout_s) as ui:
        return ui.move_alias(model_name, alias, version)
