"""Trainer configuration: pydantic-settings, env prefix `FLYWHEEL_TRAINER_`.

Shared settings (Kafka, MLflow URI, model name, ship interval) stay in app/settings.py
(`FLYWHEEL_*`); everything specific to the trainer lives here, one description per field.
Parsed before torch is imported (trainer/launch.py), so a bad value fails in milliseconds
with a message that names the variable.

    FLYWHEEL_TRAINER_LR=3e-5 FLYWHEEL_TRAINER_BATCH_SIZE=32 flywheel trainer
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from app.settings_base import FlywheelSettings

PAUSE_POINTS = ("after_optimizer_step", "before_register", "after_register")


class TrainerConfig(FlywheelSettings):
    """Everything `flywheel trainer` needs beyond app.settings.Settings."""

    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_TRAINER_", extra="ignore", validate_default=True
    )

    # --- optimisation ----------------------------------------------------------------------
    lr: float = Field(
        1e-6,
        gt=0,
        description="AdamW learning rate. 1e-6 is the usual rate for RL fine-tuning of a pretrained LLM (TRL's GRPOConfig, verl's actor) and keeps the deltas between versions sparse (docs/DESIGN.md §Delta sync, docs/DELTA.md); the demo's tiny policy uses 1e-4.",
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    max_grad_norm: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    batch_size: int = Field(
        16,
        ge=1,
        description="Rollouts per optimizer step; a step waits for this many fresh rollouts (or `max_wait_s`).",
    )
    max_wait_s: float = Field(
        2.0,
        ge=0,
        description="A step runs on a partial batch once the oldest buffered rollout waited this long.",
    )
    partial_batch_lr: Literal["scale", "full"] = Field(
        "scale",
        description="A step on a partial batch (fewer than `batch_size` rollouts after `max_wait_s`): `scale` runs it at lr x rollouts / batch_size (linear scaling rule: Adam's step has about the same size on 2 rollouts as on 16, so small noisy batches otherwise move the weights as far as full ones); `full` at lr.",
    )
    seed: int = Field(0, description="Seed of torch's RNG (policy init when no checkpoint exists).")

    # --- objective (trainer/objective.py) ------------------------------------------------------
    trunc_c: float = Field(
        2.0,
        gt=0,
        description="Token-level importance-ratio truncation C: weights are min(pi/pi_behav, C).",
    )
    seq_mask_low: float = Field(
        0.5,
        gt=0,
        description="Sequences whose geometric-mean token ratio is below this are masked.",
    )
    seq_mask_high: float = Field(
        2.0,
        gt=0,
        description="Sequences whose geometric-mean token ratio is above this are masked.",
    )
    clip_high: float = Field(
        0.0,
        ge=0,
        description='PPO\'s clip against the behaviour policy, positive side: a token of a rollout with a positive advantage whose ratio pi/pi_behav is above 1 + this gets no policy gradient, so stale rollouts stop pushing what the trainer has already learned from them (docs/TRAINER.md "Stale rollouts and the trust clip"; 0: off).',
    )
    clip_low: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="PPO's clip, negative side: a token with a negative advantage whose ratio is below 1 - this gets no policy gradient (0: off).",
    )
    max_staleness: int = Field(
        4,
        ge=0,
        description="Rollouts generated more than this many versions before the last shipped one, and before the serving champion, are skipped (and counted); the champion's own rollouts are never stale.",
    )
    adv_scale: Literal["group", "none"] = Field(
        "group",
        description="Advantage scale: `group` divides each group's centred rewards by the group's std (GRPO); `none` keeps them in reward units (Dr. GRPO), so two completions that differ by noise get a small advantage, not +-1 (docs/TRAINER.md).",
    )
    adv_negative_scale: float = Field(
        1.0,
        ge=0,
        le=1,
        description='Factor on advantages below 0 (1: the policy gradient; 0: learn only from the rollouts that beat their baseline). On agent sessions a negative advantage pushes down every token of a session that failed on one decision; docs/TRAINER.md "Why it falls short" measures 0 with groups keeping the format at a rate where the skill moves.',
    )
    adv_positive_needs_success: bool = Field(
        False,
        description='Push up only agent sessions that succeeded: a rollout whose session outcome is `failure` or `abandoned` gets an advantage of at most 0 (records without an outcome are unaffected). In a group where every session failed, the one that failed with fewer tool errors is above the mean and its wrong moves are pushed up like a success\'s (docs/TRAINER.md "Why it falls short").',
    )
    kl_coef: float = Field(
        0.01,
        ge=0,
        description="Weight of the k3 KL term to the serving champion (0 disables it and the reference forward).",
    )
    kl_target: float | None = Field(
        None,
        gt=0,
        description="Adaptive KL: the per-token KL to the champion (nats) to hold; each step the KL weight moves by up to rate x 20% toward it (objective.AdaptiveKL). None = `kl_coef` fixed.",
    )
    kl_adapt_rate: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Adaptive KL: proportional gain per step (0.1: the weight changes at most 2% per step).",
    )
    distill_coef: float = Field(
        0.1,
        ge=0,
        description="Weight of self-distillation on rollouts with tool_error feedback (0 disables it).",
    )
    error_turn_advantage: float = Field(
        0.0,
        le=0,
        description="Advantage of the tokens of a call that came back as a tool error (from the byte where a malformed call broke, else from the error, to the end of that call), in place of its session's: a broken call is pushed down even in a session that succeeded and when negative advantages are scaled by 0 (0: off, every token keeps its session's; docs/TRAINER.md \"Error turns\").",
    )
    temperature: float = Field(
        1.0,
        gt=0,
        description="Sampling temperature assumed for a rollout that does not record its own (a record written before the rollout format had `temperature`; counted in flywheel_trainer_rollouts_assumed_temperature_total). Every other rollout's log-probs are recomputed at the temperature its replica sampled it at.",
    )
    replay_routes: bool = Field(
        True,
        description="Replay the MoE routes logged at inference (docs/DESIGN.md §Invariants: bit-exact numerics).",
    )
    max_abs_reward: float = Field(
        1e6,
        gt=0,
        description="Rollouts whose absolute reward exceeds this are refused (`invalid_reward`); a reward beyond float32 range (e.g. 1e300) turns every advantage of its batch into NaN.",
    )

    # --- refused rollouts (trainer/validate.py, trainer/dlq.py) ---------------------------------
    dlq_max_value_bytes: int = Field(
        262144,
        ge=0,
        description="A refused record's value is copied into its dead letter on `<ns>.dlq` up to this size; a larger one is referenced by topic/partition/offset and sha256 only (keeps the envelope under the broker's record limit).",
    )
    refusal_log_interval_s: float = Field(
        10.0,
        ge=0,
        description="Refused rollouts are logged at most once per reason per this many seconds (with the number suppressed).",
    )

    # --- shipping ----------------------------------------------------------------------------------
    min_rollouts: int = Field(
        1,
        ge=1,
        description="A ship happens only if at least this many rollouts were trained on since the last one; a due ship waits for them and happens at the step that reaches them.",
    )
    anchor_every: int = Field(
        10,
        ge=1,
        description="Every Nth version is published as a full anchor instead of a delta (app/contracts/artifacts.py).",
    )
    consumer_group: str = Field(
        "flywheel-trainer",
        description="Kafka consumer group of the rollout intake (offsets committed after each registered version).",
    )
    experiment: str = Field(
        "flywheel-trainer",
        description="MLflow experiment of the training runs (per-step metrics, shipped models).",
    )

    # --- state ---------------------------------------------------------------------------------
    state_dir: Path | None = Field(
        None,
        description="Trainer state directory (checkpoint, dedupe set). Default: `<FLYWHEEL_DATA_DIR>/trainer`.",
    )
    checkpoint_every: int = Field(
        10,
        ge=1,
        description="Save the full trainer state every N optimizer steps (and always right before a ship).",
    )
    dedupe_capacity: int = Field(
        2_000_000,
        ge=1,
        description="How many recent request_ids the dedupe set keeps (oldest evicted first).",
    )

    # --- base checkpoint (first start with an empty registry) --------------------------------------
    policy: Annotated[dict[str, Any], NoDecode] = Field(
        default_factory=dict,
        description='Policy config (JSON) for `build_policy` when there is no checkpoint yet; {} = the built-in default; {"type": "hf", "model_dir": DIR} = a Hugging Face causal LM whose base weights are its directory\'s own (no pretraining).',
    )
    lora: Annotated[dict[str, Any] | None, NoDecode] = Field(
        None,
        description='LoRA instead of full fine-tuning (JSON, policy/lora_spec.py): {"r": 8, "alpha": 16, "dropout": 0, "target_modules": ["q_proj", "v_proj"], "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}; only the adapter trains and a version is the base model plus the adapter. Needs a Hugging Face policy (FLYWHEEL_TRAINER_POLICY type hf, or a registry whose versions are one, e.g. after `flywheel model import`). Unset or empty = full fine-tuning.',
    )
    pretrain_steps: int = Field(
        300,
        ge=0,
        description="Pretraining steps on the synthetic code corpus for the base checkpoint (first start only; not used for a Hugging Face policy).",
    )
    pretrain_agent_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of the pretraining documents that are agent sessions over the sandbox's tools (trainer/corpus.py `agent_document`; `flywheel run --agents` sets it): the base then knows the tool-call format, not the tasks' answers.",
    )
    pretrain_hack_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of those agent sessions that edit the test file instead of the code (the reward hack's seed, docs/ROLLOUT.md).",
    )
    pretrain_agent_skill: float = Field(
        0.25,
        ge=0,
        le=1,
        description='How often the corpus\'s agent sessions try the right operator first (0.25, the default, as `flywheel run --agents` pretrains: at random, the base knows the moves but not the tasks; a higher prior is not picked up by pretraining, docs/TRAINER.md "Why it falls short").',
    )
    pretrain_mid_steps: int = Field(
        0,
        ge=0,
        description='Mid-training steps after pretraining, on sessions of an agent that is always right (trainer/pretrain.py `midtrain`, 8 a step at 1e-3; first start only): a base that holds the agent tasks\' skill weakly, for RL to sharpen (docs/TRAINER.md "Why it falls short"). 0: none.',
    )
    pretrain_mid_target: float | None = Field(
        None,
        gt=0,
        le=1,
        description="The base's p(right) after mid-training: its mass on the verb's operator over 48 held-out agent tasks (trainer/skill_probe.py, probed every 5 steps; `PRETRAIN_MID_STEPS` is then a cap). Mid-training stops at the first probe that reaches it, which can be a base holding one verb with the others at chance, or, with `PRETRAIN_MID_PEAK`, is scaled back to it (docs/TRAINER.md \"Why it falls short\"). Unset: all `PRETRAIN_MID_STEPS`.",
    )
    pretrain_mid_peak: float | None = Field(
        None,
        gt=0,
        le=1,
        description='With `PRETRAIN_MID_TARGET` below it: mid-train on to the first probe at this p(right), past the onset of every verb, then scale the mid-training\'s update back along the straight line to the pretrained weights until the probe is at the target (trainer/pretrain.py `scale_back`): a base that holds every verb above chance (docs/TRAINER.md "Why it falls short").',
    )
    pretrain_mid_lines: int = Field(
        1,
        ge=1,
        description='With `PRETRAIN_MID_PEAK`: mid-train this many lines from the pretrained weights (each its own stream of sessions, scaled back to the target) and keep the base that tells the verbs apart most (trainer/pretrain.py `midtrain_lines`, trainer/skill_probe.py `separation`): which line a run gets is otherwise chance, and a base that read two verbs as one left them at chance for a whole run (docs/TRAINER.md "Why it falls short"). About 2 minutes a line on 2 cores (run 13).',
    )
    pretrain_threads: int | None = Field(
        None,
        ge=0,
        description="Torch threads while pretraining the base (unset: the process's setting; 0: every core). `flywheel run` sets 0: nothing else has work before the base exists.",
    )
    base_checkpoint: Path | None = Field(
        None,
        description="A serving safetensors file to start from instead of pretraining (first start only).",
    )

    # --- operations -----------------------------------------------------------------------------
    metrics_port: int = Field(
        9102, ge=0, le=65535, description="Prometheus /metrics port (0 disables the HTTP server)."
    )
    poll_timeout_ms: int = Field(200, ge=1, description="Kafka poll timeout of the intake.")
    rebase_on_reject: bool = Field(
        True,
        description="When the gate fails a version this trainer shipped (any failing check: confidently worse reward than the champion, more broken tool calls, ...; a planted version excepted), continue from the champion's weights with fresh optimizer moments instead of from the rejected line.",
    )
    verdict_check_s: float = Field(
        15.0,
        gt=0,
        description="How often the trainer reads the gate's verdicts on its versions (MLflow version tags).",
    )
    verdict_wait_ahead: int = Field(
        0,
        ge=0,
        description='When the last shipped version is this many versions ahead of the serving champion and is still awaiting its verdict (no gate verdict yet, or in its canary), stop training until it has one or the champion moves: bounds how far the weights run ahead of the policy that samples the rollouts (0: never wait; docs/TRAINER.md "Waiting for a verdict").',
    )
    plant_bad_version: int = Field(
        0,
        ge=0,
        description="DEMO: ship version N with its weights blown up (the largest matrix x64) so the gate can be seen stopping it; the trainer keeps training from its real weights. 0 = never.",
    )
    pause_at: str | None = Field(
        None,
        description=f"TEST HOOK: pause forever at a point ({', '.join(PAUSE_POINTS)}; `after_optimizer_step:N` = at step N; a suffix `@R` = on rank R only), writing `<state_dir>/paused-at` (with the rank and pid) so a test can SIGKILL the process there.",
    )

    # --- ranks (torchrun; trainer/distributed.py) ------------------------------------------------------
    nproc: int = Field(
        1,
        ge=1,
        le=1024,
        description="`flywheel trainer` starts this many ranks on this host with torchrun (1 = one process, no torch.distributed). Under torchrun itself, WORLD_SIZE decides.",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="With nproc > 1: how many times torchrun restarts every rank after one fails or is killed (the state resumes from the last save; docs/SCALING.md).",
    )
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="With more than one rank: `ddp` replicates the weights and sums gradients over ranks; `fsdp` shards them with FSDP2 `fully_shard` (Hugging Face policies) for models that do not fit one device.",
    )
    dist_backend: Literal["gloo", "nccl"] | None = Field(
        None,
        description="torch.distributed backend of the ranks; default NCCL when CUDA is available, else gloo.",
    )
    dist_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Timeout of the ranks' collectives (a rank waiting longer on the others fails with an error; torchrun then restarts all of them).",
    )
    ship_barrier_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long the ranks wait for each other to commit their offsets after rank 0 registered a version.",
    )
    grad_bucket_mb: float = Field(
        25.0,
        gt=0,
        description="Size of the buckets in which gradients are summed over ranks (MiB).",
    )

    @field_validator("policy", mode="before")
    @classmethod
    def _policy_json(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                v = json.loads(v) if v.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"FLYWHEEL_TRAINER_POLICY must be a JSON object, e.g. '{{\"d_model\": 64}}': {exc}"
                ) from None
        if isinstance(v, dict) and v.get("type") == "hf":
            model_dir = v.get("model_dir")
            if not model_dir or not (Path(str(model_dir)) / "config.json").is_file():
                raise ValueError(
                    f"FLYWHEEL_TRAINER_POLICY: model_dir {model_dir!r} of the hf policy is not a "
                    "Hugging Face model directory (no config.json in it)"
                )
        return v

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_json(cls, v: Any) -> Any:
        from pydantic import ValidationError

        from policy.lora_spec import LoraSpec

        if isinstance(v, str):
            if not v.strip():
                return None
            try:
                v = json.loads(v)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"FLYWHEEL_TRAINER_LORA must be a JSON object, e.g. '{{\"r\": 8}}': {exc}"
                ) from None
        if v is None or v == {}:
            return None
        if not isinstance(v, dict):
            raise ValueError(f"FLYWHEEL_TRAINER_LORA must be a JSON object, got {v!r}")
        try:
            return LoraSpec(**v).model_dump()
        except ValidationError as exc:
            errs = "; ".join(
                f"{'.'.join(str(x) for x in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors()
            )
            raise ValueError(f"FLYWHEEL_TRAINER_LORA: {errs}") from None

    @field_validator("pause_at")
    @classmethod
    def _known_pause_point(cls, v: str | None) -> str | None:
        if v is not None and v.split("@")[0].split(":")[0] not in PAUSE_POINTS:
            raise ValueError(
                f"FLYWHEEL_TRAINER_PAUSE_AT {v!r} must be one of {PAUSE_POINTS} (optionally `:N`, then `@RANK`)"
            )
        return v

    @model_validator(mode="after")
    def _lora_needs_hf(self) -> TrainerConfig:
        if self.lora is not None and self.policy and self.policy.get("type", "moe-byte") != "hf":
            raise ValueError(
                "FLYWHEEL_TRAINER_LORA needs a Hugging Face policy; FLYWHEEL_TRAINER_POLICY is type "
                f"{self.policy.get('type', 'moe-byte')!r} (set it to "
                '\'{"type": "hf", "model_dir": DIR}\' or import a model with `flywheel model import`)'
            )
        return self

    @model_validator(mode="after")
    def _mask_range(self) -> TrainerConfig:
        if not self.seq_mask_low <= 1.0 <= self.seq_mask_high:
            raise ValueError(
                f"sequence mask range [{self.seq_mask_low}, {self.seq_mask_high}] must contain 1.0 "
                "(set FLYWHEEL_TRAINER_SEQ_MASK_LOW <= 1 <= FLYWHEEL_TRAINER_SEQ_MASK_HIGH)"
            )
        return self

    @model_validator(mode="after")
    def _mid_peak_above_target(self) -> TrainerConfig:
        peak, target = self.pretrain_mid_peak, self.pretrain_mid_target
        if peak is not None and (target is None or peak <= target):
            raise ValueError(
                f"FLYWHEEL_TRAINER_PRETRAIN_MID_PEAK ({peak}) is where mid-training is scaled back "
                f"from, so it needs FLYWHEEL_TRAINER_PRETRAIN_MID_TARGET set below it (it is {target})"
            )
        if self.pretrain_mid_lines > 1 and peak is None:
            raise ValueError(
                f"FLYWHEEL_TRAINER_PRETRAIN_MID_LINES ({self.pretrain_mid_lines}) picks among "
                "scaled-back mid-training lines by their probe: it needs "
                "FLYWHEEL_TRAINER_PRETRAIN_MID_PEAK and FLYWHEEL_TRAINER_PRETRAIN_MID_TARGET"
            )
        return self

    def resolved_state_dir(self, data_dir: Path) -> Path:
        return self.state_dir if self.state_dir is not None else Path(data_dir) / "trainer"
