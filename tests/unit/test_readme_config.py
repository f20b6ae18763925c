"""The README's configuration reference is exactly what `flywheel config --markdown` prints
(regenerate with: python -m app.config_reference > /dev/null; see the README section)."""

from pathlib import Path

from app.config_reference import markdown

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_configuration_reference_is_generated_from_the_settings():
    text = README.read_text()
    start, end = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"
    assert start in text and end in text, "README lost its config-reference markers"
    block = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert block == markdown().strip(), (
        "README config reference is stale: run `python -m app.config_reference --write`"
    )
