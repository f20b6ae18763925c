"""What the gate reads: registered versions' weights from MLflow and held-out rollouts from Kafka.

    runner = GateRunner(settings, client, GateConfig(), n_rollouts=256)
    result = runner.run(version="7", champion="6")

Weights: the trainer's artifacts (`<source>/artifacts/weights.safetensors` bf16 serving
weights and `config.json` for `policy.build_policy`; trainer/registry.py). The parent
is the version tag `parent_version`. Held-out rollouts: the newest `n_rollouts` records of
`<ns>.rollouts` at offsets the version did not train on (at or past the end of its
`kafka_offsets` ranges tag), deduplicated by request_id (the topic is compacted and
at-least-once), without relabelled records (`relabel_run`: old generations under another spec).
The reward model is fitted on the newest `n_reward_rollouts` records; one read of the topic serves both.
"""

from __future__ import annotations

import json
import logging
import tempfile
from typing import Any

import torch

from app.controller.gate import GateConfig, GateInputs, GateResult, distinct_prompts, run_gate
from app.settings import Settings

log = logging.getLogger(__name__)


BASE_VERSION = "1"  # the pretrained base or the imported model: what every version descends from
AGENT_VERDICTS_KEPT = 16  # versions whose gate sessions a GateRunner keeps (GateRunner.run)


def _download(client, model: str, version: str, rel: str, dst: str) -> str:
    import mlflow

    mv = client.get_model_version(model, version)
    return mlflow.artifacts.download_artifacts(
        artifact_uri=f"{mv.source}/{rel}", dst_path=dst, tracking_uri=client.tracking_uri
    )


def load_version(
    client, model: str, version: str
) -> tuple[Any, dict[str, torch.Tensor], dict[str, str]]:
    """(policy with the version's serving weights, the bf16 state dict of the weights it computes
    with (`Policy.effective_state_dict`: a LoRA version's adapter merged into its base, so a LoRA
    child and its full parent compare tensor by tensor), the version's tags)."""
    from safetensors.torch import load_file

    from policy import build_policy
    from policy.hf_files import ensure_from_artifacts

    tags = dict(client.get_model_version(model, version).tags or {})
    with tempfile.TemporaryDirectory(prefix="flywheel-gate-") as tmp:
        state = load_file(_download(client, model, version, "artifacts/weights.safetensors", tmp))
        with open(_download(client, model, version, "artifacts/config.json", tmp)) as f:
            config = json.load(f)
    ensure_from_artifacts(  # an HF version's model files (policy/hf_files.py)
        config, client.get_model_version(model, version).source, client.tracking_uri
    )
    policy = build_policy(config)
    if all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point()):
        policy.load_serving_state_dict(state)
        # the weights it computes with (LoRA: the adapter merged), comparable across layouts
        state = policy.effective_state_dict() or state
    if hasattr(policy, "set_kernels"):
        # the gate's statistics need fp32 accuracy, not the replicas' bit-exact batch invariance;
        # plain torch ops are ~10x faster here (a gate went from 83 s to 10 s on one busy core)
        policy.set_kernels("default")
    policy.eval()
    return policy, state, tags


def newest_rollouts(settings: Settings, limit: int) -> list[tuple[int, int, dict[str, Any]]]:
    """About the newest `limit` rollouts of the topic (an equal share per partition) as (partition,
    offset, record), deduplicated by request_id (the newest wins), relabelled records left out."""
    from kafka import TopicPartition

    from app.infra.kafka import make_consumer

    if limit <= 0:
        return []
    topic = settings.topic("rollouts")
    consumer = make_consumer(settings, group_id=None, consumer_timeout_ms=2000)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        if not tps:
            return []
        consumer.assign(tps)
        begin, end = consumer.beginning_offsets(tps), consumer.end_offsets(tps)
        per = max(1, limit // len(tps))
        for tp in tps:
            consumer.seek(tp, max(begin[tp], end[tp] - per))
        out: dict[str, tuple[int, int, dict[str, Any]]] = {}
        for rec in consumer:
            if rec.value:
                r = json.loads(rec.value)
                if not r.get(
                    "relabel_run"
                ):  # a replay of old generations under another spec: not what serves now
                    out[r.get("request_id", f"{rec.partition}:{rec.offset}")] = (
                        rec.partition,
                        rec.offset,
                        r,
                    )
            if all(consumer.position(tp) >= end[tp] for tp in tps):
                break
        return list(out.values())[-limit:]
    finally:
        consumer.close()


def held_out(
    rollouts: list[tuple[int, int, dict[str, Any]]], trained: dict[str, Any] | None, limit: int
) -> list[dict[str, Any]]:
    """The newest `limit` of `rollouts` at offsets past the trained ranges ({"partitions": {p: [start, end]}})."""
    ends = {int(p): int(r[1]) for p, r in ((trained or {}).get("partitions") or {}).items()}
    past = [r for p, o, r in rollouts if o >= ends.get(p, 0)]
    return past[-limit:] if limit > 0 else []


class GateRunner:
    def __init__(
        self,
        settings: Settings,
        client,
        cfg: GateConfig,
        n_rollouts: int,
        n_reward_rollouts: int = 2000,
    ):
        self.settings, self.client, self.cfg, self.n_rollouts = settings, client, cfg, n_rollouts
        self.n_reward_rollouts = n_reward_rollouts
        self._base: dict[str, Any] = {}  # model -> BASE_VERSION's policy (a version never changes)
        # model -> version -> its agent sessions' verdicts under this gate's config: the newest
        # AGENT_VERDICTS_KEPT versions (a champion and the base are usually among them)
        self._agent_verdicts: dict[str, dict[str, list[Any]]] = {}

    def reference_version(self, model: str, tags: dict[str, str]) -> str | None:
        """The version the weight-change check compares with: the nearest ancestor the gate did
        not fail and that is not a planted bad version. A rejected parent (e.g. a corrupted
        checkpoint) is skipped, or every child trained past it would fail for differing from the
        bad weights rather than for its own; so is a planted one (`planted_bad`: the demo blew up
        the weights it shipped, not the trainer's), which the gate may never have judged when a
        newer version superseded it in the queue."""
        parent = tags.get("parent_version")
        seen: set[str] = set()
        while parent not in (None, "", "none") and parent not in seen:
            seen.add(parent)
            ptags = self.client.get_model_version(model, parent).tags or {}
            if ptags.get("flywheel.gate.status") != "failed" and ptags.get("planted_bad") != "true":
                return parent
            log.info(
                "parent v%s failed the gate or was planted bad; comparing weights with its own "
                "parent instead",
                parent,
            )
            parent = ptags.get("parent_version")
        return None

    def base_policy(self, model: str) -> Any:
        """The first version's policy, the edit monitors' fixed reference (GateInputs.base): loaded
        on the first gate that needs it, then kept (it was downloaded again for every gate)."""
        if model not in self._base:
            self._base[model] = load_version(self.client, model, BASE_VERSION)[0]
        return self._base[model]

    def run(self, version: str, champion: str | None) -> GateResult:
        model = self.settings.model_name
        cand, cand_state, tags = load_version(self.client, model, version)
        parent = self.reference_version(model, tags)
        parent_state = load_version(self.client, model, parent)[1] if parent else None
        champ = (
            load_version(self.client, model, champion)[0]
            if champion and champion != version
            else None
        )
        base = self.base_policy(model) if BASE_VERSION not in (version, champion) else None
        trained = json.loads(tags["kafka_offsets"]) if tags.get("kafka_offsets") else None
        # one read serves both: the reward model may learn from any logged rollout (it judges the
        # candidate, it is not it); the off-policy estimate needs rollouts the version did not train on
        newest = newest_rollouts(self.settings, max(self.n_rollouts, self.n_reward_rollouts))
        rolls = held_out(newest, trained, self.n_rollouts)
        fit_on = (
            [r for _, _, r in newest[-self.n_reward_rollouts :]]
            if self.n_reward_rollouts > 0
            else []
        )
        # the paired comparison samples fresh completions from both policies, so any logged prompt
        # will do, trained on or not: the newest distinct ones, as many as the config asks for
        prompts = distinct_prompts([r for _, _, r in newest])[: self.cfg.sample_prompts]
        log.info(
            "gating %s v%s: parent %s, champion %s, %d held-out rollouts, %d prompts sampled, "
            "reward model on %d",
            model,
            version,
            parent,
            champion,
            len(rolls),
            len(prompts),
            len(fit_on),
        )
        verdicts = self._agent_verdicts.setdefault(model, {})
        result = run_gate(
            GateInputs(
                candidate_state=cand_state,
                parent_state=parent_state,
                candidate=cand,
                champion=champ,
                base=base,
                rollouts=rolls,
                reward_rollouts=fit_on,
                prompts=prompts or None,
                agent_verdicts=verdicts,
                versions={"candidate": version, "champion": champion or "", "base": BASE_VERSION},
            ),
            self.cfg,
        )
        keep = {version, champion, BASE_VERSION}
        for old in [v for v in verdicts if v not in keep][
            : max(0, len(verdicts) - AGENT_VERDICTS_KEPT)
        ]:
            del verdicts[old]  # oldest first: dicts keep insertion order
        return result
