"""`flywheel model export VERSION --out DIR [--merged]`: a registered version as a directory for
users who serve it elsewhere.

    out = export_version(3, Path("exported"), mlflow_uri, "flywheel-policy", merged=False)
    AutoModelForCausalLM.from_pretrained(out)                                   # full / merged
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out), out / "adapter")  # LoRA

The version is rebuilt exactly as a replica rebuilds it (its policy config from the registry, the
model files from the version's artifacts verified by `files_sha256`, the serving weights) and
written by policy/lora.py `export_dir`: config, generation config, tokenizer files and
`model.safetensors`. A full version's weights are its bf16 serving weights. A LoRA version is its
base plus `adapter/` (`adapter_config.json`, `adapter_model.safetensors`), or with `merged` the
adapter merged into the base (peft `merge_and_unload`, fp32 weights: merging rounds once per
weight, so its logits are close to, not bit-equal with, the policy's; docs/TRAINER.md).

The directory is written next to `out` and renamed into place, so `out` is never half-written;
an `out` that exists and is not empty is refused.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


class ExportError(ValueError):
    """Bad input to `flywheel model export`; the message says what and where."""


def export_version(
    version: int,
    out: Path,
    mlflow_uri: str,
    model_name: str,
    merged: bool = False,
    cache_root: Path | None = None,
) -> Path:
    from mlflow.exceptions import MlflowException

    from policy import build_policy
    from policy.lora import export_dir
    from trainer.registry import Registry

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not an empty directory")
    registry = Registry(mlflow_uri, model_name)
    try:
        registry.client.get_model_version(model_name, str(version))
    except MlflowException:
        raise ExportError(f"{model_name} has no version {version}") from None
    config = registry.policy_config(version, cache_root)
    if config.get("type") != "hf":
        raise ExportError(
            f"{model_name} v{version} is a built-in policy (type {config.get('type', 'moe-byte')!r}); "
            "only Hugging Face versions export as a transformers directory"
        )
    if cache_root is not None and config.get("model_dir") is None:
        config["model_dir"] = str(Path(cache_root) / config["files_sha256"])
    policy = build_policy(config)
    policy.load_serving_state_dict(registry.download_serving_state(version))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        export_dir(policy, tmp, merged=merged)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
