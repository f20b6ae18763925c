"""`flywheel model`: bring your own Hugging Face causal LM (trainer/model_import.py,
trainer/model_export.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from app.cli.common import _refused, _say, _settings, console

model_app = typer.Typer(no_args_is_help=True, help="Bring your own Hugging Face causal LM.")


@model_app.command("import")
def model_import(
    model_dir: Annotated[
        Path,
        typer.Argument(help="A save_pretrained directory: config.json, *.safetensors, tokenizer."),
    ],
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Delete the registered model's versions and import as version 1."
        ),
    ] = False,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="When the registered model's versions were imported from this very model (same "
            "files and weights), keep them (publishing v1's version_registered if the deployment "
            "log lacks it) and exit 0: an import step run on every start.",
        ),
    ] = False,
) -> None:
    """Validate MODEL_DIR and register it as version 1 of FLYWHEEL_MODEL_NAME, with champion on it;
    its `version_registered` goes on the deployment log (Kafka must answer, or nothing is registered)."""
    from policy.hf_files import CACHE_DIR
    from trainer.model_import import (
        DeploymentLogUnavailable,
        ModelImportError,
        import_model,
    )

    settings = _settings()
    try:
        done = import_model(
            model_dir,
            settings,
            force=force,
            resume=resume,
            cache_root=settings.data_dir / CACHE_DIR,
        )
    except ModelImportError as exc:
        raise _refused(f"model import refused: {exc}") from None
    except DeploymentLogUnavailable as exc:
        _say(f"model import failed: {exc}")
        raise typer.Exit(1) from None
    if done.resumed:
        missing = "; its missing version_registered event published" if done.published else ""
        _say(f"{model_dir} already imported: versions kept (--resume){missing}")
        return
    console.print(f"imported {model_dir} as {settings.model_name} v{done.version} (champion)")


@model_app.command("export")
def model_export(
    version: Annotated[int, typer.Argument(help="The registered version to export.")],
    out: Annotated[
        Path, typer.Option("--out", help="Directory to write (must not exist or be empty).")
    ],
    merged: Annotated[
        bool,
        typer.Option(
            "--merged",
            help="LoRA: merge the adapter into the base weights (else base + adapter/ for peft).",
        ),
    ] = False,
) -> None:
    """Write VERSION of FLYWHEEL_MODEL_NAME as a directory AutoModelForCausalLM.from_pretrained loads."""
    from policy.hf_files import CACHE_DIR
    from trainer.model_export import ExportError, export_version

    settings = _settings()
    try:
        path = export_version(
            version,
            out,
            settings.mlflow_uri,
            settings.model_name,
            merged=merged,
            cache_root=settings.data_dir / CACHE_DIR,
        )
    except ExportError as exc:
        raise _refused(f"model export refused: {exc}") from None
    lora = (path / "adapter").is_dir()
    console.print(
        f"exported {settings.model_name} v{version} to {path}"
        + (" (base + adapter/ for peft)" if lora else " (merged)" if merged else "")
    )
