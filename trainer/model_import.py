"""`flywheel model import DIR`: a user's Hugging Face causal LM directory becomes version 1 of the
registered model, with `champion` on it.

    policy = validate(Path("/models/my-qwen-moe"))            # ModelImportError on bad input
    done = import_model(dir, settings, force=False, resume=False)   # Imported(version=1, ...)

Everything is validated before anything is written to the registry, so bad input registers nothing:

- `config.json` present and loadable; its `model_type` has an `AutoModelForCausalLM` class and
  the `architectures` it names (when it names any) is that class (a `BertModel` directory is refused);
- weights: at least one `*.safetensors`, every file readable to its last tensor (a truncated or
  corrupt file is refused), and the model loads from them with `AutoModelForCausalLM`;
- tokenizer: its files present, and every token id (`len(tokenizer)`, eos, bos) below the model's
  embedding rows;
- the registered model holds no versions, unless `force` (then the registered model is deleted,
  with its versions and aliases, and created again, so the import is version 1). When its first
  version was imported from this very model (the same config and tokenizer files, `hf_files_sha256`,
  and the same bf16 serving weights, the `checkpoint_sha256` of its `delta` tag), the error is
  `AlreadyImported`: `flywheel model import --resume` (a deployment's import step, run on every
  start) and `flywheel run --model` take that as "keep the versions" and go on;
- the deployment log (`<ns>.deployments` on FLYWHEEL_KAFKA_BOOTSTRAP) answers and exists: an
  import whose registration the log could not record is refused (`DeploymentLogUnavailable`)
  before anything is written.

The version is registered as the trainer registers a ship (trainer/registry.py): the pyfunc
model with bf16 serving weights, the policy config made self-contained (`files_sha256`, the HF
files under `model/artifacts/hf/`), and next to it the sync artifacts of app/contracts/artifacts.py
for a first version (a full anchor with per-tensor and whole-checkpoint SHA-256s, no parent). The
files are then materialized into this machine's cache, so a trainer here starts without a download.

The deployment log then says so, as it does for every registered version: one `version_registered`
event (source `import`, actor `flywheel-model-import`; details: the run and ship ids, 0 rollouts,
the model files' `hf_files_sha256`, the directory, and the artifact hints of app/contracts/hints.py
with the anchor's checkpoint SHA-256). `champion` is set as the trainer sets it on its first version
(acknowledged, app/contracts/aliases.py), so the controller records it on the log as it does the
trainer's (`alias_changed` from `controller`, `record_serving_champion`): no event for it here. The
event's id is `vr-import-<run id>`, a function of the registered version, and once Kafka
acknowledged it the version is tagged `deployment_event` (`<event id> <topic>[<partition>]@<offset>`).
A version without that tag (Kafka failed between the registration and the event, or the process
died there) gets its event from `--resume`, with the same id (the projections dedupe on it); a
tagged one gets none, so resuming never duplicates it.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.contracts.aliases import sync_aliases
from app.contracts.artifacts import publish_version
from app.contracts.deployments import DeploymentEvent, DeploymentLog
from app.contracts.hints import artifact_hints
from app.settings import Settings
from trainer.registry import CHAMPION, TAG_SHIP_ID, Registry

log = logging.getLogger(__name__)

KIND = "import"
SOURCE = "import"  # DeploymentEvent.source of the import's events
ACTOR = "flywheel-model-import"
TAG_EVENT = "deployment_event"  # on the version once its version_registered is acknowledged


class ModelImportError(ValueError):
    """Bad input to `flywheel model import`; the message names the file or field."""


class AlreadyImported(ModelImportError):
    """The registered model's versions descend from an import of this very model."""


class DeploymentLogUnavailable(RuntimeError):
    """Kafka or the deployments topic is not there: before the registration nothing was written;
    after it (the message says which) `--resume` publishes the missing event."""


@dataclass(frozen=True)
class Imported:
    """What `import_model` did: `version` is champion; `resumed` when the versions were already
    this import's (`resume`); `published` when this call published its `version_registered`."""

    version: int
    resumed: bool
    published: bool


def _check_architecture(model_dir: Path) -> Any:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg_file = model_dir / "config.json"
    if not cfg_file.is_file():
        raise ModelImportError(f"{cfg_file}: missing (a model directory has config.json)")
    try:
        raw = json.loads(cfg_file.read_text())
        hf_config = AutoConfig.from_pretrained(str(model_dir))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelImportError(f"{cfg_file}: cannot be loaded: {exc}") from None
    model_type = hf_config.model_type
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if causal is None or getattr(hf_config, "is_encoder_decoder", False):
        raise ModelImportError(
            f"{cfg_file}: model_type {model_type!r} is not a causal LM "
            "(AutoModelForCausalLM has no class for it)"
        )
    names = {causal} if isinstance(causal, str) else set(causal)
    archs = raw.get("architectures") or []
    if archs and not set(archs) & names:
        raise ModelImportError(
            f"{cfg_file}: architectures {archs} is not a causal LM (expected {sorted(names)})"
        )
    return hf_config


def _check_weights(model_dir: Path) -> None:
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelImportError(f"{model_dir}: no *.safetensors weights file")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        missing = sorted(s for s in shards if not (model_dir / s).is_file())
        if missing:
            raise ModelImportError(f"{index}: names missing weights files {missing}")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    st.get_tensor(key)
        except Exception as exc:  # safetensors raises its own SafetensorError on a bad header
            raise ModelImportError(f"{f}: corrupt or truncated safetensors: {exc}") from None


def validate(model_dir: str | Path) -> Any:
    """The HF policy of `model_dir` (policy/hf.py) after every check of the module
    docstring; ModelImportError naming the file or field otherwise."""
    from policy import build_policy
    from policy.hf import TOKENIZER_FILES, tokenizer_files

    d = Path(model_dir)
    if not d.is_dir():
        raise ModelImportError(f"{d}: no such directory")
    _check_architecture(d)
    _check_weights(d)
    if not tokenizer_files(d):
        raise ModelImportError(f"{d}: no tokenizer files (looked for {', '.join(TOKENIZER_FILES)})")
    try:
        policy = build_policy({"type": "hf", "model_dir": str(d)})
    except Exception as exc:  # transformers' errors are many types: all mean "does not load"
        raise ModelImportError(
            f"{d}: AutoModelForCausalLM or its tokenizer does not load: {exc}"
        ) from None
    tok = policy.tokenizer
    rows = tok.vocab_size
    n_tokens = len(tok.hf)
    ids = {
        f"the largest token id (len(tokenizer) = {n_tokens})": n_tokens - 1,
        "eos_token_id": tok.eos_id,
    }
    if tok.bos_id is not None:
        ids["bos_token_id"] = tok.bos_id
    for what, i in ids.items():
        if i >= rows:
            raise ModelImportError(
                f"{d / 'tokenizer.json'}: {what} is {i}, but config.json vocab_size gives the "
                f"model {rows} embedding rows"
            )
    return policy


def import_model(
    model_dir: str | Path,
    settings: Settings,
    force: bool = False,
    resume: bool = False,
    cache_root: str | Path | None = None,
) -> Imported:
    """Validate `model_dir` and register it as version 1 of `settings.model_name` with `champion`
    on it, then publish its `version_registered` (module docstring). With `resume`, versions that
    are an import of this very model are kept (AlreadyImported otherwise) and a missing event is
    published; DeploymentLogUnavailable when the deployment log cannot take the event."""
    from policy.hf_files import materialize, pack

    d = Path(model_dir).resolve()
    policy = validate(d)
    serving = policy.serving_state_dict()
    files, sha = pack(d)
    check_deployment_log(settings)  # before any write: a registration the log cannot record is none
    model_name = settings.model_name
    reg = Registry(settings.mlflow_uri, model_name)
    existing = _existing_versions(reg)
    tok = policy.tokenizer
    config = {  # upload_ship registers it with model_dir None and the files' sha (registry.py)
        **policy.config_dict(),
        "name": tok.name.split("@", 1)[0],  # the cache dir's name is a hash: keep the tokenizer id
        "model_dir": str(d),
        "files_sha256": sha,
    }
    registered_config = {**config, "model_dir": None}
    if existing:
        held = _held(reg, existing, sha, serving)
        if resume and isinstance(held, AlreadyImported):
            mv = reg.client.get_model_version(model_name, str(existing[0]))
            published = publish_registered(settings, mv, registered_config)
            return Imported(int(mv.version), resumed=True, published=published)
        if not force:
            raise held
        log.warning("--force: deleting registered model %s (versions %s)", model_name, existing)
        reg.client.delete_registered_model(model_name)
    ship_id = f"import-{sha[:16]}"
    run_id = reg.start_run()
    with tempfile.TemporaryDirectory(prefix="flywheel-import-") as tmp:
        m = publish_version(Path(tmp) / "delta", "1", serving, None, None, None)
        source = reg.upload_ship(
            run_id,
            ship_id,
            serving,
            config,
            {"name": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id},
            [],
            {"delta": Path(tmp) / "delta"},
        )
    delta = {
        "status": "published",
        "version": m.version,
        "parent": None,
        "anchor": True,
        "delta_bytes": None,
        "chain_depth": m.chain_depth,
        "checkpoint_sha256": m.checkpoint_sha256,
        "delta_file": None,
        "delta_sha256": None,
    }
    tags = {
        "kind": KIND,
        "parent_version": "none",
        "rollouts_consumed": "0",
        "imported_from": str(d)[:4000],
        "hf_files_sha256": sha,
        "delta": json.dumps(delta, sort_keys=True),
        "rollout_status": "registered",
    }
    version = reg.create_version(source, run_id, ship_id, tags)
    reg.end_run(run_id)
    if version != 1:  # another writer registered first: never leave a half-meant champion
        raise ModelImportError(
            f"registered model {model_name!r} got version {version} (another writer?); "
            "champion not moved"
        )
    sync_aliases(reg.client, model_name, {CHAMPION: str(version)})
    materialize(files, cache_root)
    mv = reg.client.get_model_version(model_name, str(version))
    published = publish_registered(settings, mv, registered_config)
    log.info("imported %s as %s v%d (champion); model files %s", d, model_name, version, sha)
    return Imported(version, resumed=False, published=published)


def check_deployment_log(settings: Settings) -> None:
    """DeploymentLogUnavailable unless the broker at FLYWHEEL_KAFKA_BOOTSTRAP answers within one
    dependency check's time (app/infra/wait.py CHECK_TIMEOUT_S) and `<ns>.deployments` has
    partitions."""
    from app.infra.kafka import make_consumer
    from app.infra.wait import CHECK_TIMEOUT_S

    topic = settings.topic("deployments")
    ms = int(CHECK_TIMEOUT_S * 1000)
    try:
        consumer = make_consumer(
            settings,
            group_id=None,
            bootstrap_timeout_ms=ms,
            request_timeout_ms=ms + 1000,
            client_id="flywheel-model-import",
        )
        try:
            parts = consumer.partitions_for_topic(topic)
        finally:
            consumer.close()
    except Exception as exc:  # kafka-python raises many types (NoBrokersAvailable, timeouts)
        raise DeploymentLogUnavailable(
            f"Kafka at {settings.kafka_bootstrap} does not answer ({type(exc).__name__}: {exc}); "
            "nothing registered (the deployment log must record the import)"
        ) from None
    if not parts:
        raise DeploymentLogUnavailable(
            f"topic {topic} does not exist on Kafka at {settings.kafka_bootstrap} (`flywheel kafka "
            "topics` creates it); nothing registered (the deployment log must record the import)"
        )


def registered_event(model: str, mv: Any, config: dict[str, Any]) -> DeploymentEvent:
    """The `version_registered` event of the imported version `mv` (an MLflow ModelVersion) whose
    registered policy config is `config`; the same event (id included) every time it is built."""
    tags = dict(mv.tags or {})
    delta = json.loads(tags.get("delta") or "{}")
    return DeploymentEvent(
        event_id=f"vr-import-{mv.run_id}",
        type="version_registered",
        model=model,
        version=str(mv.version),
        source=SOURCE,
        actor=ACTOR,
        reason=f"imported a Hugging Face model as version {mv.version} (champion)",
        details={
            "run_id": mv.run_id,
            "ship_id": tags.get(TAG_SHIP_ID),
            "rollouts_consumed": 0,
            "reward_spec": None,
            "imported_from": tags.get("imported_from", "")[:1024],
            "hf_files_sha256": tags.get("hf_files_sha256"),
            # a full anchor: replicas verify it by this checkpoint hash (app/contracts/hints.py)
            "artifacts": artifact_hints(mv.source, config, delta.get("checkpoint_sha256")),
        },
    )


def publish_registered(settings: Settings, mv: Any, config: dict[str, Any]) -> bool:
    """Publish the `version_registered` of `mv` unless its TAG_EVENT says it was acknowledged; then
    tag it. True if this call published. DeploymentLogUnavailable (naming `--resume`) on failure."""
    if (mv.tags or {}).get(TAG_EVENT):
        return False
    event = registered_event(settings.model_name, mv, config)
    dlog = DeploymentLog(settings)
    try:
        partition, offset = dlog.publish(event)
    except Exception as exc:  # KafkaError, or a timeout waiting for the ack
        raise DeploymentLogUnavailable(
            f"{settings.model_name} v{mv.version} is registered (champion) but its "
            f"version_registered event is not on {dlog.topic}: {type(exc).__name__}: {exc}; "
            "`flywheel model import DIR --resume` publishes it"
        ) from None
    finally:
        _close(dlog)
    Registry(settings.mlflow_uri, settings.model_name).set_tag(
        int(mv.version), TAG_EVENT, f"{event.event_id} {dlog.topic}[{partition}]@{offset}"
    )
    return True


def _close(dlog: DeploymentLog) -> None:
    try:
        dlog.close()
    except Exception as exc:  # a broker gone while flushing: the publish already said what matters
        log.warning("closing the deployment log producer: %s", exc)


def _held(
    reg: Registry, existing: list[int], sha: str, serving: dict[str, Any]
) -> ModelImportError:
    """Why `existing` versions stop the import: AlreadyImported when the first one is an import of
    the same files (`sha`) and weights (`serving`), ModelImportError naming the difference otherwise."""
    from kernels.delta.hashing import checkpoint_sha256

    first = reg.client.get_model_version(reg.name, str(existing[0]))
    tags = dict(first.tags or {})
    held = tags.get("hf_files_sha256")
    prefix = f"registered model {reg.name!r} already holds versions {existing}"
    if tags.get("kind") == KIND and held == sha:
        weights = json.loads(tags.get("delta") or "{}").get("checkpoint_sha256")
        if weights == checkpoint_sha256(serving):
            return AlreadyImported(
                f"{prefix}, imported from this model (v{first.version}: same files and weights); "
                "--resume keeps them, --force deletes them and imports as version 1"
            )
        other = "the same config and tokenizer files, other weights"
    elif held:
        other = f"other config or tokenizer files, files_sha256 {held[:16]}"
    else:
        other = "not imported from a Hugging Face model directory: the built-in policy?"
    return ModelImportError(
        f"{prefix} of another model (v{first.version}: {other}); "
        "`flywheel model import --force` deletes them and imports as version 1"
    )


def _existing_versions(reg: Registry) -> list[int]:
    from mlflow.exceptions import MlflowException

    try:
        reg.client.get_registered_model(reg.name)
    except MlflowException:
        return []
    return [int(mv.version) for mv in reg.versions()]
