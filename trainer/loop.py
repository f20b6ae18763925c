"""The continuous trainer: consume rollouts, train, ship a registered version every interval.

Named steps (torchtitan style): `train_step` (poll -> batch -> objective -> optimizer),
`maybe_ship` (register a version, then commit Kafka offsets), `state_dict` (everything a
restart needs), `save`, `close`. `run` loops over them until asked to stop.

Exactly-once and crash safety (docs/TRAINER.md has the full protocol):
- the intake's `positions` move only when rollouts are trained on or skipped, and are saved in
  the same file as the weights, so a restart continues right after the last saved step;
- a ship first saves the state with a ship *intent* (a fresh ship_id, the offsets and the
  lineage), then uploads artifacts, then creates the version with every tag in one call
  (tag `ship_id`), then commits the offsets, then clears the intent; a restart that finds an
  intent looks the ship_id up in the registry and either finishes (commit) or redoes the ship.

What counts as trained: only the rollouts an optimizer step consumed. Lineage and the
`trained` counter are updated after the step succeeded. A step that raises is not fatal:
each rollout of the batch is probed alone (forward + backward, no optimizer step), the ones
that raise alone are dead-lettered as `step_failed` with the exception, the rest are retried
as one step; if that raises too (a failure of the batch as a whole), all of them are
dead-lettered. Between `take()` and that accounting the in-memory state is not saved by
`close()`, so a process that dies there restarts from the last consistent save.

    from trainer.loop import Trainer
    t = Trainer(settings, TrainerConfig()); t.run(stop_event); t.close()

Ranks (torchrun; trainer/distributed.py, docs/SCALING.md "Trainer"): with a `World` of N > 1 ranks,
each rank reads the rollouts partitions p with p % N == rank (assigned, not a group member),
the ranks agree on every step (a global batch of `batch_size` split over what they hold, a rank
with nothing taking part with zero gradient), the loss of each rank is normalised by the global
batch's token counts and the gradients are summed over ranks, so the weights stay identical on
every rank. Rank 0 alone talks to the registry for writes and writes the one state file: a save
gathers every rank's positions, new dedupe keys and lineage into it, so weights and the positions
of all ranks are saved together, atomically. A ship: rank 0 saves the intent, registers, then
every rank commits its own partitions' offsets, then all meet at a barrier.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from app.infra.kafka import make_consumer, make_producer
from app.settings import Settings
from policy import Policy, build_policy
from policy.tool_format import tool_format_for
from trainer import objective as obj
from trainer.batch import Collated, collate, error_mask, scatter_teacher, teacher_inputs
from trainer.checkpoint import load_state, save_state
from trainer.config import TrainerConfig
from trainer.distributed import PeerFailure, World, allocate, owned_partitions
from trainer.dlq import DeadLetters, RateLimitedLog
from trainer.metrics import (
    ASSUMED_TEMPERATURE,
    BUFFERED,
    CONSTRAINED_TURN_TOKENS,
    ERROR_TURN_TOKENS,
    GROUPED,
    LAST_VERSION,
    PARTITIONS,
    POSITIVE_HELD_BACK,
    RANKS,
    REBASES,
    ROLLOUTS,
    SHIP_WAITING,
    SHIPS,
    STALE_TURN_TOKENS,
    STEP_FAILURES,
    STEP_GAUGES,
    STEPS,
    VERDICT_WAIT,
    VERDICT_WAIT_SECONDS,
)
from trainer.registry import CHAMPION, GATE_STATUS, Registry
from trainer.rollouts import SKIP_REASONS, Batch, DedupeSet, RolloutIntake, dedupe_key
from trainer.ship_state import Pending, ShipIntent
from trainer.shipping import execute_ship
from trainer.validate import ModelSpec, Refusal

log = logging.getLogger(__name__)


def _masked(logp: torch.Tensor, c: Collated) -> torch.Tensor:
    """`logp` [B, T] with 0.0 (no gradient) where `c.mask` is 0 when some rollout has a loss mask:
    a token the model did not sample then reads as padding in every term, whatever the policy
    makes of it (a tool result's -100 would overflow the KL's exp). Untouched otherwise."""
    return torch.where(c.mask.to(logp.device) > 0, logp, 0.0) if c.masked else logp


class StepError(RuntimeError):
    """A step whose loss or gradient is not finite (nothing was applied)."""


# how a distributed step's per-rank metrics combine into the step's (`combine_metrics`)
_SUMMED = (
    "loss",
    "pg_loss",
    "kl",
    "batch_rollouts",
    "batch_tokens",
    "distill_rollouts",
    "multi_turn_rollouts",
    "grouped_rollouts",
    "positive_held_back",
    "stale_turn_tokens",
    "constrained_turn_tokens",
    "error_turn_tokens",
)
_BY_ROLLOUTS = ("reward_mean", "ess", "clip_fraction", "masked_fraction", "staleness_mean")


def awaiting_verdict(tags: dict[str, str], candidate: int | None, version: int) -> bool:
    """Whether `version` still awaits its verdict: the gate has not judged it, or it passed and
    is in its canary (the `candidate` alias). A failed gate, a promotion or a canary that ended
    without one is a verdict."""
    status = tags.get(GATE_STATUS)
    return status is None or (status == "passed" and candidate == version)


def combine_metrics(parts: list[dict[str, float] | None]) -> dict[str, float]:
    """One step's metrics from the ranks' (None: a rank without rollouts in the step).

    Losses and counts add up (each rank's loss is already divided by the global counts);
    `staleness_max` is the max; `grad_norm` and `kl_coef` are the same on every rank; the
    per-rollout means are weighted by rollouts, the per-token ones by tokens."""
    parts = [m for m in parts if m is not None]
    if len(parts) == 1:
        return dict(parts[0])
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for m in parts for k in m):
        have = [m for m in parts if key in m]
        if key in _SUMMED:
            out[key] = float(sum(m[key] for m in have))
        elif key == "staleness_max":
            out[key] = float(max(m[key] for m in have))
        elif key in ("grad_norm", "kl_coef"):
            out[key] = float(have[0][key])
        else:
            weight = "batch_rollouts" if key in _BY_ROLLOUTS else "batch_tokens"
            total = sum(m[weight] for m in have)
            out[key] = (
                float(sum(m[key] * m[weight] for m in have) / total)
                if total
                else float(have[0][key])
            )
    return out


@dataclass(frozen=True)
class DistillTeacher:
    """The self-distillation teacher's view of a batch (trainer/batch.py `teacher_inputs`): the
    policy itself, shown the tool error's feedback, scoring what the call sampled from the error on
    (a one-call record's completion; a multi-turn record's turn). Shapes as in `ForwardPass`."""

    logprobs: torch.Tensor  # float32 [B, T], no grad: on the distilled tokens, 0 elsewhere
    # float32 [B, T]: 1 on the distilled tokens (from a tool error to the end of its call's span)
    mask: torch.Tensor
    rollouts: int  # how many of the B rollouts have a teacher (a row may have several spans)


@dataclass(frozen=True)
class ForwardPass:
    """One rank's forwards on its rollouts (`Trainer._forward`): what the loss terms are assembled
    from, no loss yet. B: the rank's rollouts in the step; T: the longest completion among them, in
    tokens; [B, T] tensors are right-padded (`batch.mask` is 1 on real completion tokens)."""

    batch: Collated  # the padded batch: behaviour log-probs and mask [B, T], rewards [B], ...
    logprobs: torch.Tensor  # float32 [B, T], with grad: the policy's, at each rollout's temperature
    weights: obj.ISWeights  # importance weights of `logprobs` vs the behaviour's (detached)
    ref_logprobs: torch.Tensor | None  # float32 [B, T], no grad: the KL reference's; None: no KL
    teacher: DistillTeacher | None  # None: distillation off, or no rollout with a teacher
    # float32 [B, T]: 1 on the tokens of calls that came back as tool errors (trainer/batch.py
    # `error_mask`); None: `error_turn_advantage` is off
    error_mask: torch.Tensor | None = None


@dataclass(frozen=True)
class Objective:
    """The loss of one `ForwardPass` (`Trainer._assemble`), before its backward."""

    loss: torch.Tensor  # scalar, with grad: pg_loss + the KL and distillation terms that apply
    pg_loss: torch.Tensor  # scalar, with grad: the policy-gradient term
    metrics: dict[str, float]  # so far: kl, kl_coef, mismatch, distill_kl, distill_rollouts
    forward: ForwardPass


@dataclass(frozen=True)
class RankShare:
    """What one rank tells the others before a step's loss (`Trainer.forward_backward`): advantages
    are normalised over the global batch, and each rank's loss divided by its token counts."""

    rewards: list[float]  # the rank's rollouts' rewards, in batch order
    groups: list[str | None]  # their group ids
    tokens: float  # completion tokens of the rank's rollouts
    kept: float  # of those, the tokens the importance weights keep
    baseline_keys: list[str]  # theirs (batch.baseline_key: a group's baseline counts each once)
    outcomes: list[str | None]  # their agent sessions' outcomes (batch.Collated.outcomes)


class Trainer:
    """One trainer process: holds the policy, optimizer, intake and registry connection."""

    def __init__(self, settings: Settings, cfg: TrainerConfig, world: World | None = None):
        self.settings, self.cfg = settings, cfg
        self.world = world if world is not None else World.single()
        self.state_dir = cfg.resolved_state_dir(settings.data_dir)
        self.registry = Registry(settings.mlflow_uri, settings.model_name, cfg.experiment)
        if self.world.is_main:
            self.registry.ensure_model()
        self.topic = settings.topic("rollouts")
        if self.world.distributed:
            state = self._shared_state()
        else:
            state = load_state(self.state_dir)
        self.policy, state = self._restore_or_bootstrap(state)
        # FSDP2 (trainer/fsdp.py): the full weights are loaded first, then sharded over the ranks
        self.sharded = self.world.distributed and cfg.parallel == "fsdp"
        if self.sharded:
            self._shard()
        self.optimizer = self._make_optimizer()
        self._load_optimizer(state)
        self.step: int = state["step"]
        self.kl_ctl = obj.AdaptiveKL(
            state.get("kl_coef", cfg.kl_coef) if cfg.kl_target is not None else cfg.kl_coef,
            cfg.kl_target,
            cfg.kl_adapt_rate,
        )
        self.last_shipped: int | None = state["last_shipped"]
        self.last_ship_at: float = state["last_ship_at"]
        self.committed: dict[int, int] = dict(state["committed"])
        self.pending = Pending.from_dict(state["pending"])
        self.intent = None if state["intent"] is None else ShipIntent.from_dict(state["intent"])
        self.verdicts_seen: int = int(
            state.get("verdicts_seen", 0)
        )  # versions up to this one were checked for a rejection
        self._verdict_checked_at = 0.0
        # waiting for the verdict on a version far ahead of the champion (verdict_wait_ahead):
        # rank 0's last reading of the registry, when it was read, and since when training waits
        self._waiting = False
        self._standing_read_at = -float("inf")
        self._wait_since: float | None = None
        # while a due ship waits for `min_rollouts`: the step it last found too few at
        self._ship_wait_step: int | None = None
        self.run_id = self.registry.start_run(state.get("run_id")) if self.world.is_main else None
        self.ref_policy: Policy | None = None
        self.parent_serving: tuple[int, dict[str, torch.Tensor]] | None = (
            None  # (version, bf16 weights) last shipped
        )
        self.ref_version: int | None = None  # the KL reference's version (kl_coef > 0)
        self.champion: int | None = None  # the serving champion, read at start, ship and rebase
        self.dlq = make_producer(settings)
        self.dead_letters = DeadLetters(self.dlq, settings.topic("dlq"), cfg.dlq_max_value_bytes)
        self.spec = ModelSpec.of(
            self.policy, replay_routes=cfg.replay_routes, max_abs_reward=cfg.max_abs_reward
        )
        # metadata refreshed every 30 s (default 5 min): a member that joined the group while a fresh
        # broker did not yet report the topic's partitions is assigned nothing until its next refresh
        self.consumer = make_consumer(
            settings,
            group_id=cfg.consumer_group,
            max_poll_records=max(64, cfg.batch_size * 4),
            metadata_max_age_ms=30_000,
        )
        # the partitions this process reads, by assignment: all of them for one process, p % size
        # == rank for a rank (trainer/distributed.py). The consumer group only holds the committed
        # offsets (commits with generation -1): no group join, so no rebalance. kafka-python
        # 3.0.12's group member was seen to stall for 5-10 minutes after the rebalance that follows
        # its first join (assigned, then never fetching; or spinning in the coordinator lookup)
        self.owned: list[int] = owned_partitions(self._topic_partitions(), self.world)
        positions = {int(p): int(o) for p, o in state["positions"].items() if int(p) in self.owned}
        if self.world.distributed:
            if not self.world.is_main:  # the lineage trained so far is in rank 0's part
                self.pending = self.pending.local_part()
            if not self.owned:
                log.warning(
                    "rank %d reads no partition: %s has fewer partitions than the %d ranks "
                    "(it still takes part in every step, with zero gradient)",
                    self.world.rank,
                    self.topic,
                    self.world.size,
                )
        self.intake = RolloutIntake(
            self.consumer,
            self.topic,
            positions=positions,
            seen=DedupeSet(cfg.dedupe_capacity, state["seen"]),
            max_staleness=cfg.max_staleness,
            spec=self.spec,
            dead_letters=self.dead_letters,
            log_interval_s=cfg.refusal_log_interval_s,
            assign=self.owned,
        )
        if self.world.distributed:
            self.intake.seen.added = []  # new keys go to rank 0 with each save
        RANKS.set(self.world.size)
        PARTITIONS.set(len(self.owned))
        self._clean_stop = False
        self._unsaved_take = (
            False  # a batch left the buffer and is not accounted yet: close() must not save
        )
        self._warn = RateLimitedLog(cfg.refusal_log_interval_s)
        if (
            self.intent is not None
        ):  # a ship was in flight when the last process died, or this is the base
            log.info(
                "resuming ship %s (parent v%s)",
                self.intent.ship_id,
                self.intent.parent_version,
            )
            self._finish_ship()
        self._refresh_champion()
        LAST_VERSION.set(self.last_shipped or 0)

    # --- start-up ----------------------------------------------------------------------------------
    def _shard(self) -> None:
        """Shard the (fully loaded) policy over the ranks with FSDP2; Hugging Face policies only."""
        from trainer.fsdp import shard_policy

        kind = self.policy.config_dict().get("type", "moe-byte")
        if kind != "hf":
            raise ValueError(
                f"FLYWHEEL_TRAINER_PARALLEL=fsdp shards Hugging Face policies; this policy is {kind!r} "
                "(use ddp: it fits one device)"
            )
        shard_policy(self.policy)

    def _load_optimizer(self, state: dict[str, Any]) -> None:
        """The saved optimizer state, when it was saved by the same kind of ranks (an FSDP state
        is keyed by parameter name, a one-process/DDP one by position)."""
        if not state.get("optimizer"):
            return
        saved_sharded = state.get("parallel") == "fsdp"
        if saved_sharded != self.sharded:
            log.warning(
                "the saved optimizer state is from %s training and this trainer is %s: starting with "
                "fresh optimizer moments (the weights are the saved ones)",
                "sharded" if saved_sharded else "unsharded",
                "sharded" if self.sharded else "unsharded",
            )
            return
        if not self.sharded:
            self.optimizer.load_state_dict(state["optimizer"])
            return
        from trainer.fsdp import load_train_state

        main = self.world.is_main
        load_train_state(
            self.policy,
            self.optimizer,
            state["fsdp_model"] if main else None,
            state["optimizer"] if main else None,
        )

    def _shared_state(self) -> dict[str, Any]:
        """The state file every rank starts from. On a first start rank 0 makes it (the base
        policy, or the newest registered version) while the others wait, so all ranks start from
        the same weights and the same saved positions."""
        if self.world.is_main and load_state(self.state_dir) is None:
            policy, fresh = self._restore_or_bootstrap(None)
            if load_state(self.state_dir) is None:  # continuing from a registered version
                save_state(
                    self.state_dir,
                    dict(
                        fresh, model=policy.train_state_dict(), policy_config=policy.config_dict()
                    ),
                )
        self.world.barrier("the first state file", self.cfg.dist_timeout_s)
        state = load_state(self.state_dir)
        assert state is not None, f"rank 0 wrote no state to {self.state_dir} (a shared directory?)"
        return state

    def _topic_partitions(self, timeout_s: float = 120.0) -> list[int]:
        """The rollouts topic's partitions (launch.py waited for the topic to exist)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.consumer.topics()  # refreshes the metadata
            parts = self.consumer.partitions_for_topic(self.topic)
            if parts:
                return sorted(parts)
            assert time.monotonic() < deadline, (
                f"no partitions of {self.topic} in the broker's metadata after {timeout_s:.0f}s"
            )
            time.sleep(1.0)

    def _make_optimizer(self) -> torch.optim.Optimizer:
        """AdamW over the trainable parameters only (with LoRA: the adapter; the base is frozen)."""
        cfg = self.cfg
        params = [p for p in self.policy.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)

    def _with_lora_setting(self, policy: Policy, source: str, convert: bool = True) -> Policy:
        """`policy` as FLYWHEEL_TRAINER_LORA wants it (policy/lora.py `with_lora_setting`)."""
        from policy.lora import with_lora_setting

        return with_lora_setting(policy, self.cfg.lora, source, convert)

    def _version_policy(self, version: int) -> Policy:
        """Registered `version`'s policy with its serving weights, as FLYWHEEL_TRAINER_LORA wants it."""
        policy = build_policy(self.registry.policy_config(version))
        policy.load_serving_state_dict(self.registry.download_serving_state(version))
        return self._with_lora_setting(policy, f"registered v{version}")

    def _saved_policy(self, config: dict[str, Any]) -> Policy:
        """The policy of the trainer state's config; a LoRA state holds the adapter only, so its
        base must be the model files the config's `files_sha256` names, here and unchanged."""
        from policy.hf_files import HFFilesError

        try:
            return build_policy(config)
        except HFFilesError as exc:
            raise RuntimeError(
                f"the trainer state in {self.state_dir} cannot be resumed: its policy's model files "
                f"(files_sha256 {config.get('files_sha256')}, the LoRA base when `lora` is set) are "
                f"gone or changed: {exc}. Restore that directory, or start with a new trainer "
                "state directory (the registry's versions are kept)"
            ) from None

    def _restore_or_bootstrap(self, state: dict[str, Any] | None) -> tuple[Policy, dict[str, Any]]:
        if state is not None:
            policy = self._saved_policy(state["policy_config"])
            if state.get("model") is not None:
                policy.load_train_state_dict(state["model"])
            else:  # saved by sharded ranks: the Hugging Face model's full state (trainer/fsdp.py)
                policy.model.load_state_dict(state["fsdp_model"])
            self._with_lora_setting(policy, f"the trainer state in {self.state_dir}", convert=False)
            log.info(
                "resumed trainer state: step %d, last shipped v%s, positions %s",
                state["step"],
                state["last_shipped"],
                state["positions"],
            )
            return policy, state
        fresh = {
            "step": 0,
            "last_shipped": None,
            "last_ship_at": time.time(),
            "committed": {},
            "positions": {},
            "seen": [],
            "pending": Pending().to_dict(),
            "intent": None,
            "optimizer": None,
            "run_id": None,
        }
        versions = self.registry.versions()
        if versions:  # local state lost but the registry has versions: continue from the newest one
            latest = int(versions[-1].version)
            policy = self._version_policy(latest)
            log.warning(
                "no trainer state in %s: starting from registered v%d (bf16 weights, fresh optimizer, "
                "offsets from the consumer group)",
                self.state_dir,
                latest,
            )
            fresh["last_shipped"] = latest
            return policy, fresh
        policy = self._with_lora_setting(self._base_policy(), "the base policy")
        fresh["intent"] = ShipIntent(
            ship_id=uuid.uuid4().hex,
            kind="base",
            parent_version=None,
            positions={},
            ranges={},
            pending=Pending(),
            step=0,
        ).to_dict()
        save_state(
            self.state_dir,
            dict(fresh, model=policy.train_state_dict(), policy_config=policy.config_dict()),
        )
        return policy, fresh

    def _base_policy(self) -> Policy:
        cfg = self.cfg
        if cfg.base_checkpoint is not None:
            from safetensors.torch import load_file

            policy = build_policy(cfg.policy or None)
            policy.load_serving_state_dict(load_file(str(cfg.base_checkpoint)))
            log.info("base checkpoint from %s", cfg.base_checkpoint)
            return policy
        if (cfg.policy or {}).get("type") == "hf":  # the weights are the model directory's own
            policy = build_policy(cfg.policy)
            log.info(
                "empty registry: the base policy is the Hugging Face model in %s (no pretraining)",
                cfg.policy.get("model_dir"),
            )
            return policy
        if cfg.pretrain_steps > 0:
            from trainer.pretrain import pretrain

            log.info("empty registry: pretraining the base policy for %d steps", cfg.pretrain_steps)
            return pretrain(
                {
                    "policy": cfg.policy or None,
                    "agent_share": cfg.pretrain_agent_share,
                    "hack_share": cfg.pretrain_hack_share,
                    "agent_skill": cfg.pretrain_agent_skill,
                    "mid_steps": cfg.pretrain_mid_steps,
                    "mid_target": cfg.pretrain_mid_target,
                    "mid_peak": cfg.pretrain_mid_peak,
                    "mid_lines": cfg.pretrain_mid_lines,
                    "threads": cfg.pretrain_threads,
                },
                cfg.pretrain_steps,
                cfg.seed,
            )
        log.warning("empty registry and pretrain_steps=0: the base policy is randomly initialised")
        return build_policy(cfg.policy or None)

    def _refresh_champion(self) -> None:
        """Read the serving champion (its rollouts are never stale) and load its weights as the
        KL reference when the alias moved."""
        # rank 0 reads the alias, so every rank takes the same champion
        champ = self.world.broadcast(
            self.registry.alias_version(CHAMPION) if self.world.is_main else None
        )
        self.champion = champ
        if self.cfg.kl_coef <= 0 or champ is None or champ == self.ref_version:
            return
        config = self.policy.config_dict()
        if (
            config.get("type") == "hf"
        ):  # the champion's own config: a LoRA line's champion may be full
            config = {**self.registry.policy_config(champ), "kernels": config.get("kernels")}
        ref = build_policy(config)
        ref.load_serving_state_dict(self.registry.download_serving_state(champ))
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        self.ref_policy, self.ref_version = ref, champ
        log.info("KL reference: champion v%d", champ)

    # --- training ------------------------------------------------------------------------------------
    def poll(self) -> None:
        self.intake.poll(self.cfg.poll_timeout_ms, max_records=max(64, self.cfg.batch_size * 4))
        BUFFERED.set(self.intake.buffered())

    def train_step(self) -> dict[str, float] | None:
        """Poll; when a batch is ready, run one optimizer step on it. Returns the step metrics.

        While waiting for a verdict (`waits_for_verdict`) the partitions are paused and nothing trains."""
        if self.waits_for_verdict():
            self.intake.hold(True)
            self.poll()  # the paused partitions return nothing; their records wait in Kafka
            return None
        self.poll()
        if not self.world.distributed:
            if not self.intake.ready(self.cfg.batch_size, self.cfg.max_wait_s):
                return None
            batch = self.intake.take(self.cfg.batch_size, self.last_shipped, self.champion)
        else:  # the ranks agree on whether to step and split the global batch
            views = self.world.all_gather(self.intake.readiness(self.cfg.max_wait_s))
            counts = [n for n, _, _ in views]
            total = sum(counts)
            if not (
                total >= self.cfg.batch_size
                or any(drain for _, drain, _ in views)
                or (total > 0 and any(waited for _, _, waited in views))
            ):
                return None
            share = allocate(counts, self.cfg.batch_size)[self.world.rank]
            batch = self.intake.take(share, self.last_shipped, self.champion)
        self._unsaved_take = True
        # every rank steps when any has rollouts (after staleness skips): zero contribution otherwise
        metrics = self._train_isolating(batch) if self.world.sum(len(batch.rollouts)) else None
        self._account(batch)  # after the step: only rollouts it consumed count as trained
        self._unsaved_take = False
        if metrics is None:
            return None
        self.step += 1
        self.pending.steps += 1
        for k, v in metrics.items():
            self.pending.metric_sums[k] = self.pending.metric_sums.get(k, 0.0) + v
        STEPS.inc()
        for k, g in STEP_GAUGES.items():
            if k in metrics:
                g.set(metrics[k])
        try:
            if self.world.is_main:
                self.registry.log_metrics(self.run_id, metrics, self.step)
        except Exception as exc:
            self._warn.warning(
                "log_metrics", "step %d metrics not logged to MLflow: %r", self.step, exc
            )
        self._pause("after_optimizer_step")
        if self.step % self.cfg.checkpoint_every == 0:
            self.save()
        return metrics

    def _train_isolating(self, batch: Batch) -> dict[str, float] | None:
        """One optimizer step on `batch`; on an exception, isolate and dead-letter the culprits.

        Leaves in `batch.rollouts` exactly the rollouts a step consumed (none if no step ran) and
        counts the others in `batch.skipped["failed"]` (their offsets in `batch.skipped_offsets`).
        Returns the step metrics or None.
        """
        try:
            return self.forward_backward(batch)
        except Exception as exc:
            STEP_FAILURES.inc()
            first = exc
            log.warning(
                "optimizer step on %d rollouts raised %r; probing them one by one",
                len(batch.rollouts),
                exc,
                exc_info=True,
            )
        culprits: dict[int, BaseException] = {}
        if self.sharded:
            pass  # probing one rollout alone would break the ranks' lockstep: the batch fails as a whole
        elif len(batch.rollouts) == 1 and not isinstance(first, PeerFailure):
            culprits[0] = first
        else:
            for i in range(len(batch.rollouts)):
                err = self._probe(batch.only([i]))
                if err is not None:
                    culprits[i] = err
        keep = [i for i in range(len(batch.rollouts)) if i not in culprits]
        metrics = None
        # with ranks, the decisions are global: a retry is one more collective step
        any_culprits, any_keep = self.world.any(bool(culprits)), self.world.any(bool(keep))
        if any_culprits and any_keep:
            retry = batch.only(keep)
            try:
                metrics = self.forward_backward(retry)
            except Exception as exc:
                STEP_FAILURES.inc()
                culprits.update((i, exc) for i in keep)
                keep = []
        elif not any_culprits:  # no rollout fails alone: the batch as a whole does
            culprits = dict.fromkeys(keep, first)
            keep = []
        for i, err in sorted(culprits.items()):
            r = batch.rollouts[i]
            src = batch.sources.get(dedupe_key(r))
            refusal = Refusal(
                "step_failed", f"the optimizer step raised on this rollout: {err!r}"[:2000]
            )
            if src is not None:
                self.intake.refuse(
                    src, refusal, exception="".join(traceback.format_exception_only(err)).strip()
                )
                batch.skip("failed", src.partition, src.offset)
            else:  # counted, but its offset is unknown: so are the lineage's skipped offsets
                batch.skipped["failed"] += 1
                self.pending.add_skipped_offsets(None)
        trained = batch.only(keep)
        batch.rollouts, batch.staleness = trained.rollouts, trained.staleness
        return metrics

    def _probe(self, batch: Batch) -> BaseException | None:
        """Forward + backward of `batch` without an optimizer step: the exception it raises, or None."""
        try:
            self.optimizer.zero_grad(set_to_none=True)
            loss = self._loss(batch).loss
            if not torch.isfinite(loss):
                raise StepError(f"loss is {float(loss)}")
            loss.backward()
            for prm in self.policy.parameters():
                if prm.grad is not None and not torch.isfinite(prm.grad).all():
                    raise StepError("gradient is not finite")
            return None
        except Exception as exc:
            return exc
        finally:
            self.optimizer.zero_grad(set_to_none=True)

    def _account(self, batch: Batch) -> None:
        p = self.pending
        for part, off in batch.first_offsets.items():
            p.first_offsets.setdefault(part, off)
        for reason in SKIP_REASONS:
            p.skipped[reason] = p.skipped.get(reason, 0) + batch.skipped[reason]
            if batch.skipped[reason]:
                ROLLOUTS.labels(reason).inc(batch.skipped[reason])
        p.add_skipped_offsets(batch.skipped_offsets)
        p.rollouts += len(batch.rollouts)
        p.request_ids.extend(r.request_id for r in batch.rollouts)
        p.reward_sum += sum(r.reward for r in batch.rollouts)
        for r in batch.rollouts:
            if r.reward_spec not in p.reward_specs:
                p.reward_specs.append(r.reward_spec)
            p.reward_spec_counts[r.reward_spec] = p.reward_spec_counts.get(r.reward_spec, 0) + 1
        p.relabelled += sum(1 for r in batch.rollouts if r.relabel_run is not None)
        p.add_sessions([r.session_id for r in batch.rollouts if r.turns is not None])
        p.turns += sum(r.trained_turns() for r in batch.rollouts)
        ROLLOUTS.labels("trained").inc(len(batch.rollouts))
        ASSUMED_TEMPERATURE.inc(sum(r.scoring_temperature() is None for r in batch.rollouts))
        STALE_TURN_TOKENS.inc(batch.stale_turn_tokens)
        CONSTRAINED_TURN_TOKENS.inc(batch.constrained_turn_tokens)

    @staticmethod
    def _step_metrics(o: Objective, batch: Batch, grad_norm: torch.Tensor) -> None:
        """Complete `o.metrics` with the step's loss, weights, staleness and gradient norm."""
        c, w, logp = o.forward.batch, o.forward.weights, o.forward.logprobs
        n_tok = float(c.mask.sum())
        stale = torch.tensor(batch.staleness, dtype=torch.float32)
        o.metrics.update(
            loss=float(o.loss.detach()),
            pg_loss=float(o.pg_loss.detach()),
            reward_mean=float(c.rewards.mean()),
            ess=w.ess,
            clip_fraction=w.clip_fraction,
            masked_fraction=w.masked_fraction,
            staleness_mean=float(stale.mean()),
            staleness_max=float(stale.max()),
            logprob_gap=float(((logp.detach() - c.behav).abs() * c.mask).sum() / max(n_tok, 1.0)),
            grad_norm=float(grad_norm),
            batch_rollouts=float(len(batch.rollouts)),
            batch_tokens=n_tok,
        )
        multi_turn = sum(r.turns is not None for r in batch.rollouts)
        if multi_turn or batch.stale_turn_tokens:  # the keys appear once multi-turn records do
            o.metrics.update(
                multi_turn_rollouts=float(multi_turn),
                stale_turn_tokens=float(batch.stale_turn_tokens),
                constrained_turn_tokens=float(batch.constrained_turn_tokens),
            )

    def _agree(self, err: BaseException | None, phase: str) -> None:
        """Every rank says whether its part of `phase` failed; all raise if any did (this rank's
        own exception, or PeerFailure naming the ranks that failed and why)."""
        views = self.world.all_gather(None if err is None else repr(err)[:500])
        failed = {r: e for r, e in enumerate(views) if e is not None}
        if err is not None:
            raise err
        if failed:
            raise PeerFailure(f"{phase} failed on rank(s) {failed}")

    def forward_backward(self, batch: Batch) -> dict[str, float]:
        """Loss, backward, clip, optimizer step. Raises before touching the weights if anything fails
        or is not finite (the optimizer step is the last thing that can change state).

        With ranks, the same step on the global batch: each rank runs its own rollouts forward; the ranks exchange rewards (advantages are
        normalised over the global batch and its groups) and token counts (each rank's loss is
        divided by the global counts); each backward is local and the gradients are summed over
        ranks, so every rank applies the same update. A rank without rollouts contributes zero.
        A failure on any rank fails the step on all of them before anything is applied. One
        process is the case of one rank: every exchange is the identity (World.single())."""
        cfg, world = self.cfg, self.world
        self.optimizer.zero_grad(set_to_none=True)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        try:
            f, err, idle = None, None, None
            try:
                if batch.rollouts:
                    f = self._forward(batch)
                elif self.sharded:  # the same forwards as the other ranks, contributing zero
                    idle = self._idle_forwards()
            except Exception as exc:
                err = exc
            self._agree(err, "the forward")
            shares: list[RankShare] = world.all_gather(
                RankShare([], [], 0.0, 0.0, [], [])
                if f is None
                else RankShare(
                    f.batch.rewards.tolist(),
                    list(f.batch.group_ids),
                    float(f.batch.mask.sum()),
                    float(f.weights.keep.sum()),
                    list(f.batch.baseline_keys),
                    list(f.batch.outcomes),
                )
            )
            rewards = torch.tensor([r for v in shares for r in v.rewards], dtype=torch.float32)
            groups = [g for v in shares for g in v.groups]
            keys = [k for v in shares for k in v.baseline_keys]
            adv = self._advantages(rewards, groups, keys, [o for v in shares for o in v.outcomes])
            start = sum(len(v.rewards) for v in shares[: world.rank])
            mine = obj.grouped(groups, keys)[start : start + len(batch.rollouts)]
            held = self._held_back(rewards, groups, keys, adv)[start : start + len(batch.rollouts)]
            tokens, kept = sum(v.tokens for v in shares), sum(v.kept for v in shares)
            o: Objective | None = None
            try:
                if f is not None:
                    o = self._assemble(f, adv[start : start + len(batch.rollouts)], tokens, kept)
                    if not torch.isfinite(o.loss):
                        raise StepError(f"loss is {float(o.loss)}")
                    o.loss.backward()
                elif idle is not None:
                    idle.backward()
            except Exception as exc:
                err = exc
            self._agree(err, "the backward")
            if self.sharded:  # FSDP reduce-scattered the summed gradients in the backward
                from trainer.fsdp import clip_grad_norm

                grad_norm = clip_grad_norm(self.policy, cfg.max_grad_norm)
            else:
                world.all_reduce_grads(params, cfg.grad_bucket_mb)
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            if not torch.isfinite(grad_norm):  # the same summed gradient on every rank
                raise StepError(f"gradient norm is {float(grad_norm)}")
            if o is not None:
                self._step_metrics(o, batch, grad_norm)
                o.metrics["grouped_rollouts"] = float(sum(mine))
                if cfg.adv_positive_needs_success:
                    o.metrics["positive_held_back"] = float(held.sum())
                    POSITIVE_HELD_BACK.inc(o.metrics["positive_held_back"])
                GROUPED.inc(sum(mine))
                ERROR_TURN_TOKENS.inc(o.metrics.get("error_turn_tokens", 0.0))
            metrics = combine_metrics(world.all_gather(None if o is None else o.metrics))
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)
            raise
        lr = cfg.lr * obj.partial_batch_lr_scale(len(rewards), cfg.batch_size, cfg.partial_batch_lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        metrics["lr"] = lr
        self.optimizer.step()
        if "kl" in metrics:
            self.kl_ctl.update(metrics["kl"])
        return metrics

    def _idle_forwards(self) -> torch.Tensor:
        """A sharded rank without rollouts: the forwards `_forward` runs on the others (the policy,
        and the self-distillation teacher when it is on), on one token, with loss x 0."""
        from trainer.fsdp import idle_participation_loss

        self.policy.train()
        loss = idle_participation_loss(self.policy)
        if self.cfg.distill_coef > 0:
            with torch.no_grad():
                idle_participation_loss(self.policy)
        return loss

    def _forward(self, batch: Batch) -> ForwardPass:
        """The forwards of `batch` (policy, KL reference, self-distillation teacher), no loss yet."""
        cfg, policy = self.cfg, self.policy
        c = collate(batch.rollouts, cfg.temperature)
        routes = c.routes if cfg.replay_routes else None
        policy.train()
        # each rollout at the temperature its replica sampled it at (the behaviour log-probs' T)
        logp = _masked(policy.logprobs(c.prompts, c.completions, routes, c.temperatures), c)
        w = obj.importance_weights(
            logp,
            c.behav,
            c.mask,
            trunc_c=cfg.trunc_c,
            mask_low=cfg.seq_mask_low,
            mask_high=cfg.seq_mask_high,
        )
        ref_lp = None
        if self.ref_policy is not None:
            with torch.no_grad():
                ref_lp = _masked(
                    self.ref_policy.logprobs(c.prompts, c.completions, routes, c.temperatures), c
                )
        teacher = None
        if cfg.distill_coef > 0:
            t = teacher_inputs(
                batch.rollouts, policy.tokenizer, policy.config_dict().get("max_context")
            )
            if t.rows:
                with torch.no_grad():
                    t_lp = policy.logprobs(t.prompts, t.tails, None, c.temperatures[t.rows])
                teacher = DistillTeacher(
                    *scatter_teacher(t_lp, t, tuple(logp.shape)), rollouts=len(set(t.rows))
                )
            elif getattr(self, "sharded", False):  # sharded ranks run the same forwards in lockstep
                from trainer.fsdp import idle_participation_loss

                with torch.no_grad():
                    idle_participation_loss(policy)
        errors = None
        if cfg.error_turn_advantage:
            fmt = tool_format_for(policy.tokenizer)
            errors = error_mask(batch.rollouts, tuple(logp.shape), policy.tokenizer, fmt) * c.mask
        return ForwardPass(c, logp, w, ref_lp, teacher, errors)

    def _assemble(
        self,
        f: ForwardPass,
        adv: torch.Tensor,
        tokens: float | None = None,
        kept: float | None = None,
    ) -> Objective:
        """The objective from a forward; `adv`: float32 [B] advantages of its rollouts.
        `tokens`/`kept`: the global batch's completion and kept tokens (ranks); None = this batch's."""
        c, logp, w = f.batch, f.logprobs, f.weights
        n_tok = float(c.mask.sum())
        m: dict[str, float] = {}
        if f.error_mask is not None:  # a call the tools could not run: pushed down on its own
            adv = obj.token_advantages(adv, f.error_mask, self.cfg.error_turn_advantage)
            m["error_turn_tokens"] = float(f.error_mask.sum())
        keep = obj.trust_keep(w, adv, self.cfg.clip_low, self.cfg.clip_high)
        pg = obj.policy_gradient_loss(
            logp, adv, w, c.mask, total=tokens, pg_keep=keep
        )  # masked sequences shrink the step (objective.py)
        loss = pg
        m["trust_clip_fraction"] = float((w.keep - keep).sum()) / max(n_tok, 1.0)
        if f.ref_logprobs is not None:
            ref_lp = f.ref_logprobs
            kl = obj.kl_k3(logp, ref_lp, w, total=kept)
            loss = loss + self.kl_ctl.coef * kl
            m["kl"], m["kl_coef"] = float(kl.detach()), self.kl_ctl.coef
            # tokens sampled by exactly these weights (a multi-turn record's: its turn's version)
            same = (c.token_versions == self.ref_version).to(torch.float32) * c.mask
            if float(same.sum()) > 0:  # the train/infer mismatch
                m["mismatch"] = float(((ref_lp - c.behav).abs() * same).sum() / same.sum())
        if f.teacher is not None:
            dl, dkl = obj.distill_loss(
                logp, f.teacher.logprobs, f.teacher.mask, w, c.mask, total=tokens
            )
            loss = loss + self.cfg.distill_coef * dl
            m["distill_kl"] = dkl
            m["distill_rollouts"] = float(f.teacher.rollouts)
        return Objective(loss, pg, m, f)

    def _loss(self, batch: Batch) -> Objective:
        """The objective on `batch` alone (no backward). One process's step, and every rank's
        probe of a single rollout."""
        f = self._forward(batch)
        return self._assemble(
            f,
            self._advantages(
                f.batch.rewards, f.batch.group_ids, f.batch.baseline_keys, f.batch.outcomes
            ),
        )

    def _advantages(
        self,
        rewards: torch.Tensor,
        groups: list[str | None],
        keys: list[str],
        outcomes: list[str | None],
    ) -> torch.Tensor:
        """The configured advantages (scale, negative scale, positive ones for successes only) of
        a batch's rewards, each session counted once in its group's baseline."""
        cfg = self.cfg
        held = obj.unsuccessful(outcomes) if cfg.adv_positive_needs_success else None
        return obj.advantages(rewards, groups, cfg.adv_scale, cfg.adv_negative_scale, keys, held)

    def _held_back(
        self, rewards: torch.Tensor, groups: list[str | None], keys: list[str], adv: torch.Tensor
    ) -> torch.Tensor:
        """Per rollout, 1.0 where `adv_positive_needs_success` held a positive advantage at 0 (a
        session that did not succeed, above its baseline), else 0.0."""
        if not self.cfg.adv_positive_needs_success:
            return torch.zeros_like(adv)
        cfg = self.cfg
        raw = obj.advantages(rewards, groups, cfg.adv_scale, cfg.adv_negative_scale, keys)
        return ((raw > 0) & (adv <= 0)).float()

    # --- shipping ------------------------------------------------------------------------------------
    def ship_due(self) -> bool:
        return time.time() - self.last_ship_at >= self.settings.ship_interval

    def maybe_ship(self, force: bool = False) -> int | None:
        """If the interval passed (or `force`) and enough rollouts were trained on, ship. Returns the version.

        A due ship that lacks `min_rollouts` waits for them, and ships at the step that reaches
        them, not an interval later: every version carries at least `min_rollouts` of learning
        whatever the traffic, and the clock only sets the earliest time."""
        if not self.world.broadcast(force or self.ship_due()):  # rank 0's clock decides
            return None
        if not force and self._ship_wait_step == self.step:
            return (
                None  # nothing trained since it found too few (the step is the same on every rank)
            )
        pending, positions = self._global_lineage()
        if pending.rollouts < self.cfg.min_rollouts:
            if self._ship_wait_step is None:
                log.info(
                    "ship due, waiting for rollouts: %d trained since v%s (min_rollouts %d)",
                    pending.rollouts,
                    self.last_shipped,
                    self.cfg.min_rollouts,
                )
                SHIP_WAITING.set(1)
            self._ship_wait_step = self.step
            return None
        ranges = {}
        for part, end in positions.items():
            start = self.committed.get(part, pending.first_offsets.get(part, end))
            if end > start:
                ranges[part] = [start, end]
        self.intent = ShipIntent(
            ship_id=self.world.broadcast(uuid.uuid4().hex),
            kind="trained",
            parent_version=self.last_shipped,
            positions=positions,
            ranges=ranges,
            pending=pending,
            step=self.step,
        )
        self.save()  # weights + intent, atomically, before anything reaches the registry
        return self._finish_ship()

    def _global_lineage(self) -> tuple[Pending, dict[int, int]]:
        """What every rank trained since the last ship, and the positions of all partitions."""
        if not self.world.distributed:
            return self.pending, dict(self.intake.positions)
        parts = self.world.all_gather((self.pending.to_dict(), dict(self.intake.positions)))
        positions: dict[int, int] = {}
        for _, pos in parts:
            positions.update(pos)
        return Pending.merge([Pending.from_dict(p) for p, _ in parts]), positions

    def _finish_ship(self) -> int:
        """Run the saved intent to the end (register, commit), then record it as shipped.

        With ranks, rank 0 runs the ship; its offset commit is the point where every rank
        commits its own partitions (`_commit_everywhere`); then rank 0 sends the version. A
        failure on rank 0 is sent to the others instead, so every rank stops with it."""
        intent = self.intent
        assert intent is not None, "_finish_ship needs a saved ship intent"
        serving = None
        if self.sharded:  # every rank takes part in the gather; rank 0 gets the bf16 weights
            from trainer.fsdp import full_serving_state

            serving = full_serving_state(self.policy)
        if self.world.is_main:
            self._commit_sent = False
            try:
                shipped = execute_ship(
                    intent,
                    registry=self.registry,
                    policy=self.policy,
                    settings=self.settings,
                    run_id=self.run_id,
                    topic=self.topic,
                    anchor_every=self.cfg.anchor_every,
                    commit_offsets=self._commit_everywhere,
                    parent_serving=self.parent_serving,
                    plant_bad_version=self.cfg.plant_bad_version,
                    pause=self._pause,
                    serving=serving,
                )
            except BaseException as exc:
                if self.world.distributed and not self._commit_sent:
                    self.world.broadcast(("failed", f"{exc!r}"[:1000]))
                raise
            version = shipped.version
            if shipped.serving is not None:
                self.parent_serving = shipped.serving
            self.world.broadcast(("shipped", version))
        else:
            self._commit_everywhere(intent.positions)
            _, version = self._from_main(intent, "register the version")
        self.last_shipped = version
        self.committed.update({int(k): int(v) for k, v in intent.positions.items()})
        if (
            intent.kind == "trained"
        ):  # nothing trains between intent and here: all of pending shipped
            self.pending = Pending()
        self.intent = None
        self.last_ship_at = time.time()
        self._ship_wait_step = None
        SHIP_WAITING.set(0)
        SHIPS.inc()
        LAST_VERSION.set(version)
        self.save()
        self._refresh_champion()
        return version

    # --- waiting for a verdict -----------------------------------------------------------------------
    def waits_for_verdict(self, now: float | None = None) -> bool:
        """Whether training waits for the verdict on the last shipped version (`verdict_wait_ahead`).

        It waits while that version is `verdict_wait_ahead` or more versions ahead of the serving
        champion and still awaiting its verdict (`awaiting_verdict`): each step trains on the
        champion's rollouts, and without a bound the weights run as far ahead of the policy that
        sampled them as the gate and canary are slow. The wait ends when the champion moves (a
        promotion), when the gate fails the version (`maybe_rebase` then goes back to the
        champion) or when its canary ends without a promotion. Once a ship has taken the trainer that
        far ahead of the champion as last read, rank 0 reads the registry every `verdict_check_s`;
        every rank takes its answer. The partitions resume and the champion is re-read when the
        wait ends.
        """
        now = time.monotonic() if now is None else now
        waiting = self.world.broadcast(self._wait_decision(now) if self.world.is_main else None)
        if waiting and self._wait_since is None:
            self._wait_since = now
            VERDICT_WAIT.set(1)
        elif not waiting and self._wait_since is not None:
            waited = now - self._wait_since
            self._wait_since = None
            VERDICT_WAIT.set(0)
            VERDICT_WAIT_SECONDS.inc(max(waited, 0.0))
            log.info("verdict wait over after %.0f s: training on", waited)
            self.intake.hold(False)
            self._refresh_champion()
        return bool(waiting)

    def _wait_decision(self, now: float) -> bool:
        ahead = self.cfg.verdict_wait_ahead
        # the champion as last read (start, ship, rebase, end of a wait): a promotion only brings
        # it closer, so the registry is read only once a ship has taken the trainer `ahead` away
        if (
            ahead <= 0
            or self.last_shipped is None
            or self.champion is None
            or self.last_shipped - self.champion < ahead
        ):
            self._waiting = False
            return False
        if now - self._standing_read_at < self.cfg.verdict_check_s:
            return self._waiting
        self._standing_read_at = now
        try:
            champion, candidate, tags = self.registry.standing(self.last_shipped)
        except Exception as exc:  # MLflow away: keep the last answer, read again next time
            self._warn.warning("standing", "version standing not read: %r", exc)
            return self._waiting
        waiting = (
            champion is not None
            and self.last_shipped - champion >= ahead
            and awaiting_verdict(tags, candidate, self.last_shipped)
        )
        if waiting and not self._waiting:
            log.info(
                "v%d is %d versions ahead of champion v%d and awaits its verdict: training waits",
                self.last_shipped,
                self.last_shipped - champion,
                champion,
            )
        self._waiting = waiting
        return waiting

    # --- rebasing on a rejection -----------------------------------------------------------------------
    def maybe_rebase(self, now: float | None = None) -> int | None:
        """Continue from the champion when the gate failed one of this trainer's versions
        (`flywheel.gate.status` = failed: confidently worse reward, more broken tool calls, ...;
        planted versions excepted). The trainer's later weights descend from that rejected line, so
        training on would ship its descendants. Returns the champion version rebased on, or None.

        Reads the verdict tags of versions newer than `verdicts_seen` every `verdict_check_s`. The
        rebase loads the champion's serving weights, clears the optimizer moments, records
        `rebased_on` in the pending lineage and saves the state, so a restart continues from there.
        """
        champ = self.world.broadcast(self._rejected_to(now) if self.world.is_main else None)
        if champ is None:
            return None
        if not self.sharded and self.registry.policy_config(champ) == self._registered_config():
            self.policy.load_serving_state_dict(self.registry.download_serving_state(champ))
            self.optimizer.state.clear()
        else:  # a LoRA line rejected back to the full base version (a fresh adapter on it), or sharded
            self.policy = self._version_policy(champ)
            if self.sharded:
                self._shard()
            self.optimizer = self._make_optimizer()
        self.pending.rebased_on = champ
        REBASES.inc()
        self.save()
        self._refresh_champion()
        return champ

    def _rejected_to(self, now: float | None) -> int | None:
        """The champion to rebase on, when the gate rejected one of this trainer's versions since
        the last check (rank 0 decides; `maybe_rebase` applies it on every rank)."""
        now = time.monotonic() if now is None else now
        if (
            not self.cfg.rebase_on_reject
            or self.last_shipped is None
            or now - self._verdict_checked_at < self.cfg.verdict_check_s
        ):
            return None
        self._verdict_checked_at = now
        rejected, newest_verdict = None, self.verdicts_seen
        for mv in self.registry.versions():
            v, tags = int(mv.version), dict(mv.tags or {})
            if v <= self.verdicts_seen or GATE_STATUS not in tags:
                continue
            newest_verdict = max(newest_verdict, v)
            if tags.get(GATE_STATUS) == "failed" and tags.get("planted_bad") != "true":
                rejected = v
        if newest_verdict == self.verdicts_seen:
            return None
        self.verdicts_seen = newest_verdict
        champ = self.registry.alias_version(CHAMPION)
        if rejected is None or champ is None or champ >= rejected:
            return None  # `verdicts_seen` is saved with the next state; re-reading passed verdicts changes nothing
        log.warning(
            "the gate failed v%d against champion v%d: continuing from v%d's weights "
            "(fresh optimizer moments)",
            rejected,
            champ,
            champ,
        )
        return champ

    def _registered_config(self) -> dict[str, Any]:
        """The policy's config as the registry records it (HF: model files by hash, no directory)."""
        config = self.policy.config_dict()
        if config.get("type") == "hf" and config.get("model_dir") is not None:
            from policy.hf_files import pack, resolve

            weights = bool(config.get("lora"))
            path = resolve(config["model_dir"], config.get("files_sha256"), weights=weights)
            config = {**config, "model_dir": None, "files_sha256": pack(path, weights)[1]}
        return config

    def _from_main(self, intent: ShipIntent, what: str) -> tuple[str, Any]:
        kind, value = self.world.broadcast(None)
        if kind == "failed":
            raise RuntimeError(
                f"rank 0 could not {what} for ship {intent.ship_id}: {value}; every rank stops and "
                "the restarted ranks resume the ship from the saved intent"
            )
        return kind, value

    def _commit_everywhere(self, positions: dict[int, int]) -> None:
        """Commit the intent's offsets: one process commits them all; with ranks, rank 0 (whose
        version is registered now) tells the others, each commits its own partitions, and all
        meet at a barrier, so no rank moves on before every offset of the version is committed."""
        if not self.world.distributed:
            self.commit_offsets(positions)
            return
        if self.world.is_main:
            self.world.broadcast(("commit", None))
            self._commit_sent = True
        else:
            self._from_main(self.intent, "register the version")  # type: ignore[arg-type]
        self.commit_offsets({p: o for p, o in positions.items() if int(p) in self.owned})
        self.world.barrier("the offset commits of a ship", self.cfg.ship_barrier_timeout_s)

    def commit_offsets(self, positions: dict[int, int]) -> None:
        from kafka.structs import OffsetAndMetadata, TopicPartition

        if positions:
            self.consumer.commit(
                {
                    TopicPartition(self.topic, int(p)): OffsetAndMetadata(int(o), "", -1)
                    for p, o in positions.items()
                }
            )

    # --- state ---------------------------------------------------------------------------------------
    def state_dict(self, full: tuple[Any, Any] | None = None) -> dict[str, Any]:
        """Everything a restart needs. `full`: a sharded trainer's (model, optimizer) state
        gathered on rank 0 (trainer/fsdp.py `full_train_state`), saved under `fsdp_model`."""
        if full is not None:
            model: dict[str, Any] = {"model": None, "fsdp_model": full[0], "parallel": "fsdp"}
            optimizer = full[1]
        else:
            model = {"model": self.policy.train_state_dict()}
            optimizer = self.optimizer.state_dict() if self.optimizer is not None else None
        return {
            **model,
            "policy_config": self.policy.config_dict(),
            "optimizer": optimizer,
            "step": self.step,
            "positions": dict(self.intake.positions),
            "seen": self.intake.seen.to_list(),
            "last_shipped": self.last_shipped,
            "last_ship_at": self.last_ship_at,
            "committed": dict(self.committed),
            "pending": self.pending.to_dict(),
            "intent": None if self.intent is None else self.intent.to_dict(),
            "run_id": self.run_id,
            "kl_coef": self.kl_ctl.coef,
            "verdicts_seen": self.verdicts_seen,
        }

    def save(self) -> None:
        """Save the state, after the dead letters of every record before the saved positions are acknowledged.

        With ranks, a collective: every rank sends rank 0 its positions, the dedupe keys it added
        since the last save and its lineage; rank 0 writes them with the weights in one file."""
        self.dead_letters.flush()
        if not self.world.distributed:
            save_state(self.state_dir, self.state_dict())
            return
        full = None
        if self.sharded:  # a collective: the full model and optimizer state on rank 0
            from trainer.fsdp import full_train_state

            full = full_train_state(self.policy, self.optimizer)
        pending, positions = self._global_lineage()
        added = self.world.all_gather(self.intake.seen.drain_added())
        if not self.world.is_main:
            return
        for keys in added[1:]:
            self.intake.seen.merge(keys)
        state = self.state_dict(full)
        state["positions"], state["pending"] = positions, pending.to_dict()
        save_state(self.state_dir, state)

    def _pause(self, point: str) -> None:
        """Test hook (FLYWHEEL_TRAINER_PAUSE_AT): stop here forever so a test can SIGKILL us.

        `point[:step][@rank]`; it writes `<state_dir>/paused-at` (point, step, rank, pid) and does
        not fire while that file exists, so ranks restarted by torchrun run past it."""
        want = self.cfg.pause_at
        if want is None:
            return
        want, _, at_rank = want.partition("@")
        name, _, at_step = want.partition(":")
        if name != point or (at_step and int(at_step) != self.step):
            return
        marker = self.state_dir / "paused-at"
        if (at_rank and int(at_rank) != self.world.rank) or marker.exists():
            return  # another rank's hook, or spent: it fires once per marker (torchrun restarts)
        marker.write_text(f"{point} step={self.step} rank={self.world.rank} pid={os.getpid()}\n")
        log.warning("paused at %s (test hook); waiting to be killed", point)
        while True:
            time.sleep(3600)

    # --- running ---------------------------------------------------------------------------------------
    def run(
        self,
        stop: threading.Event,
        on_step: Callable[[int, dict[str, float] | None], None] | None = None,
    ) -> None:
        # with ranks, a stop asked of any rank (torchrun forwards SIGTERM to all) stops them together
        while not self.world.any(stop.is_set()):
            metrics = self.train_step()
            self.maybe_rebase()
            self.maybe_ship()
            if on_step is not None:
                on_step(self.step, metrics)
        self._clean_stop = True

    def close(self) -> None:
        """Save the state and release Kafka/MLflow resources (safe after a failure)."""
        try:
            # ranks save only together, after a stop they agreed on; after a failure they restart
            # from the last save (a collective with a failed rank would not return)
            if (
                self.intent is None
                and not self._unsaved_take
                and (self._clean_stop or not self.world.distributed)
            ):
                self.save()
        finally:
            self.consumer.close(autocommit=False)
            self.dlq.close(timeout=5)
            if self.world.is_main:
                self.registry.end_run(self.run_id, "FINISHED")
            log.info("trainer closed at step %d (pid %d)", self.step, os.getpid())
