"""docs/CONFIGURATION.md is exactly what `flywheel config --markdown` prints (regenerate with
`python -m app.config_reference --write`)."""

from pathlib import Path

from app.config_reference import REFERENCE, markdown

DOC = Path(__file__).resolve().parents[2] / REFERENCE


def test_the_configuration_reference_is_generated_from_the_settings():
    text = DOC.read_text()
    start, end = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"
    assert start in text and end in text, f"{REFERENCE} lost its config-reference markers"
    block = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert block == markdown().strip(), (
        f"{REFERENCE} is stale: run `python -m app.config_reference --write`"
    )


def test_the_readme_points_to_the_reference():
    readme = (DOC.parents[1] / "README.md").read_text()
    assert REFERENCE in readme
