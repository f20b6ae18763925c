"""`flywheel pretrain`: the base policy from the synthetic code corpus (trainer/pretrain.py)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from app.cli.common import console


def pretrain_cmd(
    out: Annotated[
        str,
        typer.Option("--out", help="Directory for config.json + model.safetensors (fp32 masters)."),
    ],
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 600,
    seed: Annotated[
        int, typer.Option(help="Seed of the corpus, the initialisation and the batches.")
    ] = 0,
    batch_size: Annotated[int, typer.Option(help="Documents per step.")] = 16,
    threads: Annotated[
        int,
        typer.Option(help="torch intra-op threads (1 avoids contention on small shared boxes)."),
    ] = 1,
    agent_share: Annotated[
        float,
        typer.Option(
            help="Share of steps on agent sessions over the sandbox's tools (trainer/corpus.py; `flywheel run --agents` pretrains with 0.7)."
        ),
    ] = 0.0,
    hack_share: Annotated[
        float, typer.Option(help="Share of those sessions that edit the test file instead.")
    ] = 0.0,
    agent_skill: Annotated[
        float,
        typer.Option(
            help="How often those sessions try the verb's operator first (0.25, the default and what `flywheel run --agents` pretrains with: at random)."
        ),
    ] = 0.25,
    mid_steps: Annotated[
        int,
        typer.Option(
            help="Then this many steps on sessions of an agent that is always right (mid-training to a base that holds the skill weakly; docs/TRAINER.md)."
        ),
    ] = 0,
    mid_target: Annotated[
        float | None,
        typer.Option(
            help="The base's p(right) after mid-training (probed every 5 steps; --mid-steps is then a cap): it stops at the first probe there, or, with --mid-peak, is scaled back to it."
        ),
    ] = None,
    mid_peak: Annotated[
        float | None,
        typer.Option(
            help="With --mid-target: mid-train on to this p(right), past the onset of every verb, then scale the update back to --mid-target (a base that holds every verb above chance)."
        ),
    ] = None,
    mid_lines: Annotated[
        int,
        typer.Option(
            min=1,
            help="With --mid-peak: mid-train this many lines from the pretrained weights and keep the base that tells the verbs apart most (about 2 minutes a line on 2 cores).",
        ),
    ] = 1,
    policy_json: Annotated[
        str | None,
        typer.Option(
            "--policy",
            help="Policy config (JSON, as FLYWHEEL_TRAINER_POLICY), e.g. '{\"max_context\": 1024}' for agent sessions.",
        ),
    ] = None,
) -> None:
    """Pretrain the base policy on the synthetic code corpus and save it (trainer/pretrain.py, docs/NUMERICS.md)."""
    import torch
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from trainer.pretrain import pretrain_to_dir

    torch.set_num_threads(threads)
    with Progress(
        TextColumn("pretrain"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeRemainingColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("pretrain", total=steps + mid_steps * mid_lines, loss="-")
        policy, path = pretrain_to_dir(
            out,
            {
                "batch_size": batch_size,
                "agent_share": agent_share,
                "hack_share": hack_share,
                "agent_skill": agent_skill,
                "mid_steps": mid_steps,
                "mid_target": mid_target,
                "mid_peak": mid_peak,
                "mid_lines": mid_lines,
                "policy": json.loads(policy_json) if policy_json else None,
            },
            steps=steps,
            seed=seed,
            on_step=lambda s, loss: progress.update(task, advance=1, loss=f"{loss:.3f}"),
        )
        progress.update(task, total=progress.tasks[0].completed)  # a mid-target stops early
    sample = policy.generate(
        [policy.tokenizer.encode("def ")], max_tokens=160, temperature=0.7, seed=seed
    )[0]
    console.print(f"saved {path}; sample (T=0.7):\n[cyan]def {sample.text}[/cyan]")
