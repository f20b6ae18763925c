"""The base of every pydantic-settings class of the project: a bad value names its variable.

    class StreamsConfig(FlywheelSettings):
        model_config = SettingsConfigDict(env_prefix="FLYWHEEL_STREAMS_", ...)

    FLYWHEEL_STREAMS_METRICS_PORT=abc flywheel streams
    -> 1 validation error for StreamsConfig
       FLYWHEEL_STREAMS_METRICS_PORT (metrics_port)
         Input should be a valid integer ...

Construction raises pydantic's `ValidationError` as usual, with each error's location
rewritten from the field path (`gate.max_kl`) to the environment variable that sets it and
the path (`FLYWHEEL_CONTROLLER_GATE_MAX_KL (gate:max_kl)`), so start-up fails with the name an
operator can fix (and a keyword or CLI flag that set the field is still recognisable).
Nested models (`ControllerSettings.gate`) are reached through the class's
`env_nested_delimiter`; `env_name` is the same mapping for the configuration reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError
from pydantic_settings import BaseSettings


def env_name(cls: type[BaseSettings], path: Sequence[str]) -> str:
    """The environment variable of the field at `path` (nested models joined by the class's
    `env_nested_delimiter`)."""
    prefix = cls.model_config.get("env_prefix", "")
    delimiter = cls.model_config.get("env_nested_delimiter") or "__"
    return f"{prefix}{delimiter.join(path)}".upper()


def field_path(cls: type[BaseModel], loc: Sequence[int | str]) -> list[str]:
    """The leading part of an error location that names fields (`("steps", 2)` -> `["steps"]`)."""
    path: list[str] = []
    model: Any = cls
    for part in loc:
        fields = getattr(model, "model_fields", None) if isinstance(model, type) else None
        if not isinstance(part, str) or fields is None or part not in fields:
            break
        path.append(part)
        model = fields[part].annotation
    return path


def _named_error(cls: type[BaseSettings], exc: ValidationError) -> ValidationError:
    details: list[InitErrorDetails] = []
    for err in exc.errors(include_url=False):
        path = field_path(cls, err["loc"])
        loc = (f"{env_name(cls, path)} ({':'.join(path)})",) if path else tuple(err["loc"])
        detail = InitErrorDetails(type=err["type"], loc=loc, input=err["input"])
        if "ctx" in err:
            detail["ctx"] = err["ctx"]
        details.append(detail)
    try:
        return ValidationError.from_exception_data(cls.__name__, details)
    except (KeyError, TypeError, ValueError):  # an error type pydantic-core cannot rebuild
        return ValidationError.from_exception_data(
            cls.__name__,
            [
                InitErrorDetails(
                    type=PydanticCustomError(str(d["type"]), str(e["msg"]).replace("{", "{{")),
                    loc=d["loc"],
                    input=d["input"],
                )
                for d, e in zip(details, exc.errors(include_url=False), strict=True)
            ],
        )


class FlywheelSettings(BaseSettings):
    """A pydantic-settings class whose validation errors name the environment variables."""

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise _named_error(type(self), exc) from None
