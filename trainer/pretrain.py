"""Pretrain the base checkpoint on the synthetic code corpus (trainer/corpus.py).

    flywheel pretrain --steps 600 --out .flywheel/base        # CLI, rich progress
    policy = pretrain({"steps": 20, "policy": {"d_model": 32, "n_layers": 1}}, seed=0)  # fixtures

Each training sequence is `[bos] + one document + [eos]`, right-padded; the loss is the
next-token cross-entropy on the non-pad targets plus a small MoE load-balance term. Training
uses the `default` (BLAS) kernels for speed: the weights are the same either way, and the saved
config keeps the policy's own kernel setting (`invariant` by default) for serving and RL.
Numerics: fp32 masters, bf16-rounded forward (straight-through), AdamW in fp32.
Progress goes to the gauges `flywheel_trainer_pretrain_step` / `_steps` / `_loss` (trainer/metrics.py),
which `flywheel run`'s status view reads from the trainer's /metrics.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from policy import build_policy, save_policy
from policy.base import Policy
from trainer.corpus import AgentDocument, iter_agent_documents, iter_documents
from trainer.metrics import MID_SKILL, PRETRAIN_LOSS, PRETRAIN_STEP, PRETRAIN_STEPS

log = logging.getLogger(__name__)


class PretrainConfig(BaseModel):
    """Pretraining hyper-parameters (the defaults reach code-like text in a few CPU minutes)."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(600, ge=1, description="Optimizer steps.")
    batch_size: int = Field(16, ge=1, description="Documents per step.")
    lr: float = Field(
        3e-3, gt=0, description="Peak AdamW learning rate (linear warmup, cosine decay to 10%)."
    )
    warmup_steps: int = Field(30, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    aux_loss_coef: float = Field(0.01, ge=0, description="Weight of the MoE load-balance loss.")
    train_kernels: Literal["invariant", "default"] = Field(
        "default", description="Kernel set used while pretraining."
    )
    policy: dict[str, Any] | None = Field(
        None, description="Policy config for build_policy (None: the default)."
    )
    agent_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of steps that train on agent sessions (trainer/corpus.py `agent_document`) instead of functions.",
    )
    agent_batch_size: int = Field(
        8, ge=1, description="Agent sessions per step (each is several times a function's length)."
    )
    hack_share: float = Field(
        0.0, ge=0, le=1, description="Share of agent sessions that edit the test file instead."
    )
    agent_skill: float = Field(
        0.25,
        ge=0,
        le=1,
        description="How often the corpus's agent tries the verb's operator first (0.25: at random; the others share the rest).",
    )
    mid_steps: int = Field(
        0,
        ge=0,
        description="After pretraining, steps on sessions of an agent that is always right (`midtrain`; 0: none): mid-training to a base that holds the agent tasks' skill weakly, which the corpus's skill prior alone does not give (docs/TRAINER.md \"Why it falls short\").",
    )
    mid_target: float | None = Field(
        None,
        gt=0,
        le=1,
        description="The base's p(right) after mid-training (trainer/skill_probe.py, probed every `mid_probe_every` steps; `mid_steps` is then a cap): mid-training stops at the first probe that reaches it, or, with `mid_peak`, is scaled back to it. None: all `mid_steps`, no probe.",
    )
    mid_peak: float | None = Field(
        None,
        gt=0,
        le=1,
        description="With `mid_target`: mid-train on to the first probe whose p(right) reaches this, past the onset of every verb, then scale the mid-training's update back to `mid_target` (`scale_back`), a base that holds every verb above chance. None: stop at the first probe at `mid_target`, which can hold one verb only.",
    )
    mid_lines: int = Field(
        1,
        ge=1,
        description='With `mid_peak`: mid-train this many lines from the pretrained weights (document seeds seed+2, seed+3, ...), each scaled back to `mid_target`, and keep the base that tells the verbs apart most (the largest `separation_min`, trainer/skill_probe.py). Which line a run gets is otherwise chance, and a base that reads two verbs as one left them stuck for a whole run (docs/TRAINER.md "Why it falls short"). Each line is about 2 minutes on 2 cores (run 13).',
    )
    mid_probe_every: int = Field(
        5, ge=1, description="Mid-training steps between probes (each 2.4 s on the 1.4M policy)."
    )
    mid_lr: float = Field(
        1e-3,
        gt=0,
        description="AdamW learning rate of mid-training (constant): at 3e-4 the skill appeared after 175 steps on one base and not in 400 on another; at 1e-3 after about 120 on two streams.",
    )
    threads: int | None = Field(
        None,
        ge=0,
        description="Torch threads while pretraining (None: the process's setting; 0: every core). A run's base is pretrained before any other role has work, so it may take the machine; the process's own setting is restored after.",
    )

    @model_validator(mode="after")
    def _peak_above_target(self) -> PretrainConfig:
        if self.mid_peak is not None and (
            self.mid_target is None or self.mid_peak <= self.mid_target
        ):
            raise ValueError(
                f"mid_peak ({self.mid_peak}) needs a mid_target below it (mid_target: {self.mid_target})"
            )
        if self.mid_lines > 1 and self.mid_peak is None:
            raise ValueError(
                f"mid_lines ({self.mid_lines}) picks among scaled-back lines: it needs mid_peak "
                "and mid_target (without them there is no probe to pick by)"
            )
        return self


def _as_config(config: dict[str, Any] | PretrainConfig | None) -> PretrainConfig:
    """A PretrainConfig from itself, a dict of its fields, or a bare policy config (`Policy.config_dict()`)."""
    if isinstance(config, PretrainConfig):
        return config
    config = dict(config or {})
    if config and not set(config) & set(PretrainConfig.model_fields):
        config = {"policy": config}  # a policy config, e.g. {"type": "moe-byte", "d_model": 64}
    return PretrainConfig(**config)


def _batch(docs, policy: Policy, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Next `batch_size` documents as (inputs [B, S], targets [B, S]) with pad in the targets' tail."""
    tok = policy.tokenizer
    max_len = policy.config_dict()["max_context"]
    seqs, eos_at = [], []
    for _ in range(batch_size):
        doc = next(docs)
        text, ends = (doc.text, doc.ends) if isinstance(doc, AgentDocument) else (doc, ())
        ids = [tok.bos_id, *tok.encode(text), tok.eos_id][: max_len + 1]
        seqs.append(ids)
        # an agent turn's completion ends with eos where the text goes on with the next prompt:
        # the target at its last token is eos (its input stays the text, as a replica's next prompt)
        eos_at.append([e for e in ends if e < len(ids) - 1])
    width = max(len(s) for s in seqs) - 1
    inputs = torch.full((batch_size, width), tok.pad_id, dtype=torch.int64)
    targets = torch.full((batch_size, width), tok.pad_id, dtype=torch.int64)
    for i, s in enumerate(seqs):
        inputs[i, : len(s) - 1] = torch.tensor(s[:-1])
        targets[i, : len(s) - 1] = torch.tensor(s[1:])
        targets[i, eos_at[i]] = tok.eos_id
    return inputs, targets


def lm_loss(policy: Policy, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over non-pad targets."""
    b, s = inputs.shape
    hidden, _ = policy.forward_hidden(inputs, torch.arange(s).expand(b, s))
    logits = policy.lm_logits(hidden)
    return F.cross_entropy(
        logits.reshape(b * s, -1), targets.reshape(-1), ignore_index=policy.tokenizer.pad_id
    )


@contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `n` (0: every core; None: left as they are), then restored."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n or os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pretrain(
    config: dict[str, Any] | PretrainConfig | None = None,
    steps: int | None = None,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> Policy:
    """Build a policy and pretrain it; returns it (eval mode) with its configured kernels restored.

    `config` is a PretrainConfig, a dict of its fields, or a bare policy config dict.
    """
    cfg = _as_config(config)
    if steps is not None:
        cfg = cfg.model_copy(update={"steps": steps})
    policy_cfg = {"init_seed": seed, **(cfg.policy or {})}
    policy = build_policy(policy_cfg)
    serve_kernels = policy.config.kernels
    policy.set_kernels(cfg.train_kernels)
    torch.manual_seed(seed)
    decay = [p for p in policy.parameters() if p.dim() >= 2]
    no_decay = [p for p in policy.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    docs = iter_documents(seed)
    # a step is all functions or all agent sessions: a batch is as wide as its longest document
    agent_docs = (
        iter_agent_documents(seed + 1, cfg.hack_share, cfg.agent_skill) if cfg.agent_share else None
    )
    pick = random.Random(seed)
    policy.train()
    with _torch_threads(cfg.threads):
        # progress for the trainer's /metrics (trainer/metrics.py)
        PRETRAIN_STEPS.set(cfg.steps + cfg.mid_steps * cfg.mid_lines)
        PRETRAIN_STEP.set(0)
        t0 = time.perf_counter()
        for step in range(cfg.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            if agent_docs is not None and pick.random() < cfg.agent_share:
                inputs, targets = _batch(agent_docs, policy, cfg.agent_batch_size)
            else:
                inputs, targets = _batch(docs, policy, cfg.batch_size)
            loss = lm_loss(policy, inputs, targets)
            total = loss + cfg.aux_loss_coef * policy.aux_loss
            opt.zero_grad(set_to_none=True)
            total.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
            opt.step()
            assert math.isfinite(loss.item()), (
                f"pretraining diverged at step {step}: loss {loss.item()}"
            )
            PRETRAIN_STEP.set(step + 1)
            PRETRAIN_LOSS.set(loss.item())
            if on_step is not None:
                on_step(step, loss.item())
            if step % 50 == 0 or step == cfg.steps - 1:
                log.info(
                    "pretrain step %d/%d loss %.4f (%.0fs)",
                    step + 1,
                    cfg.steps,
                    loss.item(),
                    time.perf_counter() - t0,
                )
        if cfg.mid_steps:
            log.info(
                "mid-training on always-right agent sessions: %d steps%s%s%s%s",
                cfg.mid_steps,
                "" if cfg.mid_target is None else " at most",
                "" if cfg.mid_peak is None else f" to p(right) {cfg.mid_peak}, scaled back to",
                "" if cfg.mid_target is None else f" p(right) {cfg.mid_target}",
                ""
                if cfg.mid_lines == 1
                else f", on {cfg.mid_lines} lines (the best-separated kept)",
            )
            lines, kept = midtrain_lines(policy, cfg, seed, on_step)
            mid = lines[kept]
            if mid.skill is not None:  # probed: the progress's total is the steps taken
                log.info(
                    "mid-training: %d steps, %.3f of its update kept, p(right) %.3f (least verb "
                    "%.3f), verbs told apart by %.3f (trainer/skill_probe.py `separation`)%s",
                    mid.steps, mid.scale, mid.skill["p_right"], mid.skill["p_right_min"],
                    mid.skill["separation_min"],
                    "" if len(lines) == 1 else f": line {kept + 1} of {len(lines)}",
                )  # fmt: skip
                taken = cfg.steps + sum(line.steps for line in lines)
                PRETRAIN_STEPS.set(taken)
                PRETRAIN_STEP.set(taken)
    policy.eval()
    policy.set_kernels(serve_kernels)
    return policy


def _mid_step(step: int, loss: float, on_step: Callable[[int, float], None] | None) -> None:
    PRETRAIN_STEP.set(step + 1)
    PRETRAIN_LOSS.set(loss)
    if on_step is not None:
        on_step(step, loss)


def midtrain_lines(
    policy: Policy,
    cfg: PretrainConfig,
    seed: int,
    on_step: Callable[[int, float], None] | None = None,
) -> tuple[list[MidTraining], int]:
    """Mid-train `policy` (pretrained, `cfg.steps` steps taken) on `cfg.mid_lines` lines, each from
    the pretrained weights with its own stream of sessions (`midtrain` with seed `seed + 2 + k`
    for line k, so one line is the plain mid-training), and leave `policy` at the line whose
    scaled-back base tells the verbs apart most (the largest `separation_min`; ties: the earlier
    line). `on_step` counts the lines' steps on from `cfg.steps`. Returns (every line, the index of
    the one kept).

    Why pick: from one pretrained base, three lines' scaled-back bases (the same target, 0.4)
    told the verbs apart by 0.003, -0.011 and 0.101, and a base that read two verbs as one
    (run 11, 0.002) left both at chance for 15 versions (docs/TRAINER.md "Why it falls short")."""
    start = (
        {k: v.detach().clone() for k, v in policy.state_dict().items()}
        if cfg.mid_lines > 1
        else None
    )
    lines: list[MidTraining] = []
    kept, kept_state = 0, None
    for k in range(cfg.mid_lines):
        if k:
            policy.load_state_dict(start)
        offset = cfg.steps + sum(line.steps for line in lines)
        line = midtrain(
            policy,
            cfg.mid_steps,
            cfg.mid_lr,
            seed + 2 + k,
            on_step=lambda j, loss, o=offset: _mid_step(o + j, loss, on_step),
            target=cfg.mid_target,
            probe_every=cfg.mid_probe_every,
            hack_share=cfg.hack_share,
            peak=cfg.mid_peak,
        )
        lines.append(line)
        if cfg.mid_lines == 1:
            break
        sep = line.skill["separation_min"]
        log.info(
            "mid-training line %d of %d: p(right) %.3f, verbs told apart by %.3f (%s)",
            k + 1, cfg.mid_lines, line.skill["p_right"], sep,
            ", ".join(f"{v} {d:+.3f}" for v, d in line.skill["separation"].items()),
        )  # fmt: skip
        if k == 0 or sep > lines[kept].skill["separation_min"]:
            kept, kept_state = k, {n: v.detach().clone() for n, v in policy.state_dict().items()}
    if kept_state is not None and kept != len(lines) - 1:
        policy.load_state_dict(kept_state)
        MID_SKILL.set(lines[kept].skill["p_right"])
    return lines, kept


@dataclass
class MidTraining:
    """What `midtrain` did: its probes as (steps taken, p(right)), the steps it took, the share of
    its update the policy kept (`scale`: 1.0 unless scaled back to the target) and the policy's last
    probe (trainer/skill_probe.py `probe`; None when it did not probe)."""

    probes: list[tuple[int, float]] = field(default_factory=list)
    steps: int = 0
    scale: float = 1.0
    skill: dict | None = None


def midtrain(
    policy: Policy,
    steps: int,
    lr: float,
    seed: int,
    batch_size: int = 8,
    on_step: Callable[[int, float], None] | None = None,
    target: float | None = None,
    probe_every: int = 5,
    hack_share: float = 0.0,
    peak: float | None = None,
) -> MidTraining:
    """Fine-tune `policy` for up to `steps` on sessions of an agent that is always right
    (trainer/corpus.py `agent_document` with skill 1.0; `hack_share` of them edit the test file
    instead, as in pretraining, so a base seeded with the hack keeps it), `batch_size` a step, AdamW at a
    constant `lr` (betas 0.9, 0.95; no weight decay; clip 1.0); `on_step(step, loss)` after each.

    With a `target`, it probes the skill (trainer/skill_probe.py `probe`: p(right), the policy's
    mass on the verb's operator) before the first step and every `probe_every` steps; `steps` is
    then a cap. Without a `peak` it stops at the first probe at or above `target`. The verb-to-
    operator choice appears late and one verb at a time (docs/TRAINER.md "Why it falls short"), so
    the mean can reach the target on one verb while the others are at chance (measured: `sub` 0.64,
    the rest near 0.27 at a mean of 0.361).

    With a `peak` as well, it trains on to the first probe at or above `peak`, past the onset of
    every verb, and then scales its update back (`scale_back`) until the probe is at `target`: the
    straight line from the weights it started from to those it reached passes through bases that
    hold every verb above chance (measured on two such lines at a mean near 0.40: add / sub / mul /
    div 0.37 / 0.37 / 0.48 / 0.36 and 0.29 / 0.54 / 0.45 / 0.37, where mid-training's own path
    passed a mean of 0.36 with `mul` at 0.07). Leaves `policy` in train mode."""
    from trainer.skill_probe import probe

    opt = torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    docs = iter_agent_documents(seed, hack_share=hack_share, skill=1.0)
    done = MidTraining()
    start = {k: v.detach().clone() for k, v in policy.state_dict().items()} if peak else None
    stop_at = peak if peak is not None else target

    def reached(step: int) -> bool:
        if stop_at is None or (step % probe_every and step != steps):
            return False
        done.skill = probe(policy)
        p = done.skill["p_right"]
        done.probes.append((step, p))
        MID_SKILL.set(p)
        log.info("mid-training step %d: p(right) %.3f (stops at %.3f)", step, p, stop_at)
        return p >= stop_at

    policy.train()
    t0 = time.perf_counter()
    for step in range(steps):
        if reached(step):
            break
        inputs, targets = _batch(docs, policy, batch_size)
        loss = lm_loss(policy, inputs, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        done.steps = step + 1
        assert math.isfinite(loss.item()), f"mid-training diverged at step {step}: {loss.item()}"
        if on_step is not None:
            on_step(step, loss.item())
        if step % 50 == 0 or step == steps - 1:
            log.info(
                "mid-train step %d/%d loss %.4f (%.0fs)",
                step + 1,
                steps,
                loss.item(),
                time.perf_counter() - t0,
            )
    else:
        reached(steps)
    if start is not None and target is not None and done.skill is not None:
        if done.skill["p_right"] < peak:
            log.warning(
                "mid-training reached p(right) %.3f in %d steps, short of its peak %.3f",
                done.skill["p_right"], steps, peak,
            )  # fmt: skip
        done.scale, done.skill = scale_back(policy, start, target, done.skill)
        MID_SKILL.set(done.skill["p_right"])
    return done


def on_line(
    start: dict[str, torch.Tensor], end: dict[str, torch.Tensor], a: float
) -> dict[str, torch.Tensor]:
    """The state dict at share `a` of the straight line from `start` to `end` (start + a × (end −
    start)); non-float entries are `end`'s."""
    return {
        k: start[k] + a * (v - start[k]) if v.is_floating_point() else v for k, v in end.items()
    }


def scale_back(
    policy: Policy,
    start: dict[str, torch.Tensor],
    target: float,
    reached: dict,
    tol: float = 0.01,
    max_probes: int = 8,
) -> tuple[float, dict]:
    """Move `policy` back along the straight line to the weights `start` (start + a × (now − start))
    to the `a` whose probe's p(right) is nearest `target`, by bisection on [0, 1] (p(right) rises
    along it: docs/TRAINER.md "Why it falls short"): at most `max_probes` probes, done within `tol`.
    `reached` is the probe at a = 1; a policy at or below the target is left where it is. Returns
    (a, the probe there)."""
    from trainer.skill_probe import probe

    if reached["p_right"] <= target:
        return 1.0, reached
    end = {k: v.detach().clone() for k, v in policy.state_dict().items()}

    def at(a: float) -> dict:
        policy.load_state_dict(on_line(start, end, a))
        return probe(policy)

    best, lo, hi = (1.0, reached), 0.0, 1.0
    for _ in range(max_probes):
        a = (lo + hi) / 2
        skill = at(a)
        log.info(
            "mid-training scaled back to %.3f of its update: p(right) %.3f", a, skill["p_right"]
        )
        if abs(skill["p_right"] - target) < abs(best[1]["p_right"] - target):
            best = (a, skill)
        if abs(skill["p_right"] - target) <= tol:
            break
        lo, hi = (a, hi) if skill["p_right"] < target else (lo, a)
    if best[0] != a:  # the best was an earlier probe: its weights, without probing again
        policy.load_state_dict(on_line(start, end, best[0]))
    return best


def pretrain_to_dir(
    out_dir: str | Path,
    config: dict[str, Any] | PretrainConfig | None = None,
    steps: int | None = None,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> tuple[Policy, Path]:
    """Pretrain and save the base checkpoint (fp32 masters + config.json) to `out_dir`."""
    cfg = _as_config(config)
    if steps is not None:
        cfg = cfg.model_copy(update={"steps": steps})
    policy = pretrain(cfg, seed=seed, on_step=on_step)
    path = save_policy(policy, out_dir, extra={"pretrain": {**cfg.model_dump(), "seed": seed}})
    return policy, path
