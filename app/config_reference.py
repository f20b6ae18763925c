"""Every setting the project reads from the environment, gathered from its pydantic-settings
classes. Renders the configuration reference, docs/CONFIGURATION.md (`flywheel config --markdown`), and lets
tests check that a deployment file only sets variables that something actually reads.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_settings import BaseSettings

from app.settings_base import env_name

# modules that define pydantic-settings classes (role configs live with their role)
SETTINGS_MODULES = [
    "app.settings",
    "streams.config",
    "trainer.config",
    "app.controller.config",
    "app.replica.config",
    "app.simulate.config",
]


@dataclass(frozen=True)
class SettingInfo:
    env: str
    owner: str
    default: Any
    description: str


def settings_classes() -> list[type[BaseSettings]]:
    out = []
    for name in SETTINGS_MODULES:
        mod = importlib.import_module(name)
        for obj in vars(mod).values():
            if (
                isinstance(obj, type)
                and issubclass(obj, BaseSettings)
                and obj is not BaseSettings
                and obj.__module__ == mod.__name__
            ):
                out.append(obj)
    return out


def _rows(cls: type[BaseSettings], model: type[BaseModel], path: list[str]) -> list[SettingInfo]:
    rows = []
    for fname, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):  # a nested model: one row a field
            rows += _rows(cls, sub, [*path, fname])
            continue
        default = field.default if field.default_factory is None else field.default_factory()
        rows.append(
            SettingInfo(
                env_name(cls, [*path, fname]),
                f"{cls.__module__}.{cls.__name__}",
                default,
                field.description or "",
            )
        )
    return rows


def all_settings() -> list[SettingInfo]:
    return [row for cls in settings_classes() for row in _rows(cls, cls, [])]


def known_env_names() -> set[str]:
    return {s.env for s in all_settings()}


def markdown() -> str:
    lines = ["| variable | default | what |", "|---|---|---|"]
    for s in sorted(
        all_settings(), key=lambda s: (s.owner != "app.settings.Settings", s.owner, s.env)
    ):
        default = "" if s.default is None else f"`{s.default}`"
        lines.append(f"| `{s.env}` | {default} | {s.description} |")
    return "\n".join(lines)


REFERENCE = "docs/CONFIGURATION.md"


def write_reference(path: str = REFERENCE) -> None:
    """Replace the configuration reference block of `path` with the generated table."""
    from pathlib import Path

    p = Path(path)
    text = p.read_text()
    start, end = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    p.write_text(f"{head}{start}{markdown()}\n{end}{tail}")


if __name__ == "__main__":
    import sys

    if "--write" in sys.argv:
        write_reference()
    else:
        print(markdown())
