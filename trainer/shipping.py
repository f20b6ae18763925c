"""One ship: artifacts up, version registered with its lineage tags, event published, offsets committed.

`execute_ship(intent, ...)` runs the trainer's saved ship *intent* (trainer/ship_state.py;
trainer/loop.py saves it, atomically with the weights, before calling this) with what it is
given: the registry, the policy, the settings and the callbacks that commit offsets and pause
(for crash tests). It is idempotent, so a restarted trainer simply runs it again:

1. look the intent's ship_id up in the registry; a version that exists but is not READY is
   deleted (it can never be served), a READY one means the registration already happened;
2. otherwise upload the pyfunc model, lineage and delta (app/contracts/artifacts.py, for the predicted
   version number) under `ships/<ship_id>/` of the run, then create the version with every
   tag in ONE call (so it is never visible half-tagged);
3. set `champion` if the model has none (the first, base, version);
4. push the delta to `<ns>.deltas` when it is small enough (app/contracts/pushed.py; replicas then
   need not download it), then publish `version_registered` (event_id derived from the ship_id,
   so a re-publish dedupes). A ship resumed after a crash does not push (the bytes are gone with
   the crashed process; replicas download the delta from MLflow);
5. commit the Kafka offsets of the intent — only now, after the version is registered.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from app.contracts.aliases import sync_aliases
from app.contracts.artifacts import publish_version
from app.contracts.deployments import DeploymentEvent, DeploymentLog
from app.contracts.hints import artifact_hints
from app.contracts.pushed import PushedDelta, publish_delta
from app.settings import Settings
from kernels.delta.manifest import MANIFEST_FILE, Manifest
from policy import Policy
from trainer.registry import CHAMPION, Registry
from trainer.ship_state import ShipIntent

log = logging.getLogger(__name__)

ServingWeights = tuple[int, dict[str, torch.Tensor]]  # (version, bf16 serving weights)


def reward_spec_detail(specs: str) -> str | None:
    """The `reward_spec` of a `version_registered` event: the comma-joined specs when they fit the
    projection's column (16 characters), else None; `reward_specs` always has them all with counts."""
    return specs if specs != "none" and len(specs) <= 16 else None


def skipped_offsets_detail(intent: ShipIntent) -> dict[str, list[int]] | None:
    """The `skipped_offsets` of a `version_registered` event, `{"<partition>": [offset, ...]}`
    (ascending; partitions with none left out): the offsets of the version's `kafka_offsets`
    ranges it read and did not train on, so a reader knows every other offset there trained
    (app/api/routes/sessions.py `trained_by`). None, and the key is left out, when they are not
    known for certain: a lineage saved without them, more than MAX_SKIPPED_OFFSETS
    (trainer/ship_state.py), or a list that does not account for every offset of the ranges
    (trained + listed != the ranges' size, or listed != the skip counts): never a wrong list.
    Not an MLflow tag: it may be far longer than a tag value can be."""
    p = intent.pending
    if p.skipped_offsets is None:
        return None
    listed = sum(map(len, p.skipped_offsets.values()))
    size = sum(max(0, end - first) for first, end in intent.ranges.values())
    if listed != sum(p.skipped.values()) or p.rollouts + listed != size:
        log.warning(
            "ship %s: %d skipped offsets listed for %d skips, %d trained of ranges of %d offsets;"
            " skipped_offsets left out of the lineage",
            intent.ship_id,
            listed,
            sum(p.skipped.values()),
            p.rollouts,
            size,
        )
        return None
    return {str(k): sorted(v) for k, v in sorted(p.skipped_offsets.items()) if v}


def lineage_tags(intent: ShipIntent, topic: str) -> dict[str, str]:
    p = intent.pending
    steps = max(1, p.steps)
    summary = {k: round(v / steps, 6) for k, v in sorted(p.metric_sums.items())}
    summary.update(
        steps=p.steps,
        reward_mean=round(p.reward_sum / p.rollouts, 6) if p.rollouts else None,
    )
    return {
        "kind": intent.kind,
        "parent_version": str(intent.parent_version)
        if intent.parent_version is not None
        else "none",
        "rollouts_consumed": str(p.rollouts),
        "rollouts_skipped": json.dumps(p.skipped, sort_keys=True),
        "kafka_offsets": json.dumps(
            {"topic": topic, "partitions": {str(k): v for k, v in sorted(intent.ranges.items())}}
        ),
        # sorted: the same specs read the same whichever a batch met first
        "reward_spec": ",".join(sorted(p.reward_specs)) or "none",
        # rollouts trained per reward spec (relabelled ones under their new spec); "{}" from a pending
        # saved by a trainer that did not count them
        "reward_specs": json.dumps(p.reward_spec_counts, sort_keys=True),
        "rollouts_relabelled": str(p.relabelled),
        # distinct sessions of the multi-turn records trained on; model calls trained on (a
        # one-call record's 1, a multi-turn record's trained turns)
        "sessions_trained": str(len(p.session_ids)),
        "turns_trained": str(p.turns),
        "train_metrics": json.dumps(summary, sort_keys=True),
        "trainer_step": str(intent.step),
        "rollout_status": "registered",
        **({"rebased_on": str(p.rebased_on)} if p.rebased_on is not None else {}),
    }


def plant_bad_weights(serving: dict[str, Any]) -> dict[str, Any]:
    """A copy of `serving` with its largest matrix multiplied by 64: a checkpoint the gate must stop."""
    name = max(
        (k for k, v in serving.items() if v.dim() == 2 and v.is_floating_point()),
        key=lambda k: serving[k].numel(),
    )
    bad = dict(serving)
    bad[name] = (serving[name].float() * 64.0).to(serving[name].dtype)
    return bad


@dataclass(frozen=True)
class Shipped:
    """What a ship produced: the version, and its serving weights when this process made them
    (the next ship's delta parent without a download; None when the ship was already registered)."""

    version: int
    serving: ServingWeights | None


def execute_ship(
    intent: ShipIntent,
    *,
    registry: Registry,
    policy: Policy,
    settings: Settings,
    run_id: str,
    topic: str,
    anchor_every: int,
    commit_offsets: Callable[[dict[int, int]], None],
    parent_serving: ServingWeights | None = None,
    plant_bad_version: int | None = None,
    pause: Callable[[str], None] = lambda point: None,
    serving: dict[str, torch.Tensor] | None = None,
) -> Shipped:
    """Carry `intent` out to the end (see the module docstring). `parent_serving` is the parent's
    weights if the caller holds them; `pause(point)` is called at "before_register" and
    "after_register"; `serving`: the policy's serving weights when the caller gathered them
    (sharded ranks, trainer/fsdp.py), else `policy.serving_state_dict()`."""
    reg = registry
    ship_id = intent.ship_id
    mv = reg.find_ship(ship_id)
    if mv is not None and mv.status != "READY":
        log.warning(
            "ship %s left version %s in status %s; deleting it and shipping again",
            ship_id,
            mv.version,
            mv.status,
        )
        reg.delete_version(int(mv.version))
        mv = None
    tags = lineage_tags(intent, topic)
    pushed = None  # the delta to push before the event (none when resuming: the bytes died with the crashed run)
    shipped_serving: ServingWeights | None = None
    if mv is None:
        serving = serving if serving is not None else policy.serving_state_dict()
        tok = policy.tokenizer
        tokenizer = {"name": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id}
        # the delta's manifest names its version before the registry assigns it: predict it
        # (max version + 1; this trainer is the only writer) and repair it below if it differs
        predicted = max((int(v.version) for v in reg.versions()), default=0) + 1
        if plant_bad_version and predicted == plant_bad_version:
            serving = plant_bad_weights(serving)
            tags["planted_bad"] = "true"
            log.warning(
                "DEMO: shipping v%d with blown-up weights (FLYWHEEL_TRAINER_PLANT_BAD_VERSION)",
                predicted,
            )
        delta_args = {
            "registry": reg,
            "model_name": settings.model_name,
            "anchor_every": anchor_every,
            "parent_serving": parent_serving,
        }
        with tempfile.TemporaryDirectory(prefix="flywheel-delta-") as tmp:
            extra, delta, pushed = _publish_delta(
                Path(tmp), serving, intent, predicted, **delta_args
            )
            tags["delta"] = json.dumps(delta, sort_keys=True)
            source = reg.upload_ship(
                run_id,
                ship_id,
                serving,
                policy.config_dict(),
                tokenizer,
                intent.pending.request_ids,
                extra,
                parent_version=intent.parent_version,
            )
        pause("before_register")
        version = reg.create_version(source, run_id, ship_id, tags)
        if delta["status"] == "published" and version != predicted:
            log.error(
                "registry assigned v%d, the delta was written for v%d (deleted versions?): republishing it",
                version,
                predicted,
            )
            with tempfile.TemporaryDirectory(prefix="flywheel-delta-") as tmp:
                extra, delta, pushed = _publish_delta(
                    Path(tmp), serving, intent, version, **delta_args
                )
                reg.client.log_artifacts(run_id, str(extra["delta"]), f"ships/{ship_id}/delta")
            reg.set_tag(version, "delta", json.dumps(delta, sort_keys=True))
        shipped_serving = (version, serving)
        log.info(
            "registered %s v%d (parent %s, %s rollouts, ship %s)",
            reg.name,
            version,
            tags["parent_version"],
            tags["rollouts_consumed"],
            ship_id,
        )
    else:
        version = int(mv.version)
        source = mv.source
        log.info("ship %s was already registered as v%d; finishing it", ship_id, version)
    pause("after_register")
    if reg.alias_version(CHAMPION) is None:
        # as the controller moves aliases (acknowledging tag first), so the move is not taken for
        # an operator's move in the MLflow UI (an `alias_changed` event from "mlflow-ui")
        sync_aliases(reg.client, reg.name, {CHAMPION: str(version)})
        log.info("no champion yet: alias %s -> v%d", CHAMPION, version)
    _publish_event(settings, run_id, policy, version, intent, tags, source, pushed)
    commit_offsets(intent.positions)
    return Shipped(version, shipped_serving)


def _publish_delta(
    out: Path,
    serving: dict,
    intent: ShipIntent,
    version: int,
    *,
    registry: Registry,
    model_name: str,
    anchor_every: int,
    parent_serving: ServingWeights | None,
) -> tuple[dict[str, Path], dict[str, Any], PushedDelta | None]:
    """Delta/anchor/manifest files (app/contracts/artifacts.py) for `version`, logged as `ships/<ship_id>/delta`,
    their tag info, and the delta as an app.contracts.pushed.PushedDelta (None for an anchor-only version).

    The parent's bf16 weights and manifest come from the registry (or `parent_serving`). A parent
    shipped without a manifest makes this version an anchor (the chain restarts there).
    """
    parent = intent.parent_version
    parent_sd = manifest = None
    if parent is not None:
        manifest_json = _download_text(registry, parent, f"delta/{MANIFEST_FILE}")
        if manifest_json is None:
            log.warning(
                "parent v%s has no delta manifest: v%d is published as an anchor", parent, version
            )
            parent = None
        else:
            manifest = Manifest.model_validate_json(manifest_json)
            parent_sd = (
                parent_serving[1]
                if parent_serving and parent_serving[0] == parent
                else registry.download_serving_state(parent)
            )
            if _layout(parent_sd) != _layout(serving):
                # e.g. a full version's weights -> the first LoRA version's adapter: nothing to diff
                log.info(
                    "parent v%s has other tensors than v%d (another policy config): v%d is an anchor",
                    parent,
                    version,
                    version,
                )
                parent, parent_sd, manifest = None, None, None
    m = publish_version(
        out / "delta",
        str(version),
        serving,
        parent_sd,
        None if parent is None else str(parent),
        manifest,
        anchor_every=anchor_every,
    )
    info = {
        "status": "published",
        "version": m.version,
        "parent": m.parent_version,
        "anchor": m.anchor is not None,
        "delta_bytes": m.delta.bytes if m.delta else None,
        "chain_depth": m.chain_depth,
        # for replicas (app/contracts/hints.py): the delta they fetch alone and the hash it must give
        "checkpoint_sha256": m.checkpoint_sha256,
        "delta_file": m.delta.file if m.delta else None,
        "delta_sha256": m.delta.sha256 if m.delta else None,
    }
    # for the push to `<ns>.deltas` right before `version_registered` (app/contracts/pushed.py)
    pushed = (
        PushedDelta(
            model_name,
            m.version,
            m.parent_version,
            m.delta.file,
            m.delta.sha256,
            (out / "delta" / m.delta.file).read_bytes(),
        )
        if m.delta
        else None
    )
    return {"delta": out / "delta"}, info, pushed


def _layout(state: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {k: (str(v.dtype), tuple(v.shape)) for k, v in state.items()}


def _download_text(registry: Registry, version: int, rel: str) -> str | None:
    """A file next to `version`'s model directory (`ships/<ship_id>/<rel>`), or None if absent."""
    import mlflow
    from mlflow.exceptions import MlflowException

    mv = registry.client.get_model_version(registry.name, str(version))
    root = mv.source.rsplit("/model", 1)[0]
    with tempfile.TemporaryDirectory(prefix="flywheel-parent-") as tmp:
        try:
            path = mlflow.artifacts.download_artifacts(
                artifact_uri=f"{root}/{rel}", dst_path=tmp, tracking_uri=registry.uri
            )
        except (MlflowException, OSError):
            return None
        return Path(path).read_text()


def _publish_event(
    settings: Settings,
    run_id: str,
    policy: Policy,
    version: int,
    intent: ShipIntent,
    tags: dict[str, str],
    source: str,
    pushed: PushedDelta | None = None,
) -> None:
    d = json.loads(tags.get("delta", "{}"))
    ok = d.get("status") == "published" and d.get("version") == str(
        version
    )  # the manifest made for this version
    hints = artifact_hints(
        source,
        policy.config_dict(),
        d.get("checkpoint_sha256") if ok else None,
        d.get("parent"),
        {"file": d["delta_file"], "sha256": d["delta_sha256"], "bytes": d["delta_bytes"]}
        if ok and d.get("delta_file")
        else None,
    )
    skipped = skipped_offsets_detail(intent)
    event = DeploymentEvent(
        event_id=f"vr-{intent.ship_id}",
        type="version_registered",
        model=settings.model_name,
        version=str(version),
        from_version=None if intent.parent_version is None else str(intent.parent_version),
        source="trainer",
        actor="flywheel-trainer",
        reason=f"{tags['kind']} version: {tags['rollouts_consumed']} rollouts",
        details={
            "run_id": run_id,
            "ship_id": intent.ship_id,
            "rollouts_consumed": int(tags["rollouts_consumed"]),
            "reward_spec": reward_spec_detail(tags["reward_spec"]),
            "reward_specs": json.loads(tags["reward_specs"]),
            "rollouts_relabelled": int(tags["rollouts_relabelled"]),
            "sessions_trained": int(tags["sessions_trained"]),
            "turns_trained": int(tags["turns_trained"]),
            "kafka_offsets": json.loads(tags["kafka_offsets"]),
            # the offsets of those ranges it read and did not train on, when known for certain
            **({"skipped_offsets": skipped} if skipped is not None else {}),
            "train_metrics": json.loads(tags["train_metrics"]),
            # where replicas fetch it without asking MLflow (optional; app/contracts/hints.py)
            "artifacts": hints,
        },
    )
    if (
        ok
        and hints.get("delta")
        and pushed is not None
        and (pushed.version, pushed.file, pushed.sha256)
        == (str(version), d["delta_file"], d["delta_sha256"])
    ):
        # before the event: a replica that reads the event has the bytes (or downloads them: nothing lost)
        publish_delta(settings, pushed)
    dlog = DeploymentLog(settings)
    try:
        dlog.publish(event)
    finally:
        dlog.close()
