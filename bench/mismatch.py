"""The vLLM engine against the trainer: log-prob mismatch on the same weights, update time, serving pause.

    .venv/bin/python -m bench.mismatch --quick                  # tiny Qwen2-MoE, ~2-5 min on 2 cores
    .venv/bin/python -m bench.mismatch --model moe,dense --json /tmp/mismatch.json

One vLLM server per model (app/replica/engines/vllm.py `VLLMServer` + `VLLMEngine`, vLLM's own
environment from deploy/vllm/ensure.sh, started here and stopped in `finally`) and the trainer's
HF policy (`build_policy({"type": "hf", ...})`) hold the same bf16 serving state of a tiny model
built with tests/hf_models.py (`moe`: Qwen2-MoE, head_dim 64, 4 experts top-2 + a shared expert;
`dense`: Llama, head_dim 64; vLLM's CPU attention refuses smaller heads). Measured in one run:

1. **Mismatch.** Completions sampled by vLLM at T = 1 (`--prompts` prompts x `--samples` each x
   `--tokens` tokens), with vLLM's behaviour log-probs, scored by the trainer's `logprobs()` with
   `kernels: "default"` and `"invariant"`: max and mean |Δ log-prob|, the fraction of tokens whose
   float32 log-probs differ at all and by more than 1e-3, two estimates of KL(vLLM || trainer) on
   the sampled tokens (k1 = mean(lp_vllm - lp_trainer), k3 = mean(r - 1 - log r), r =
   exp(lp_trainer - lp_vllm)), and what the trainer's off-policy correction
   (trainer/objective.py `importance_weights`, the trainer's defaults C = 2, mask [0.5, 2]) does
   with them: tokens clipped, sequences masked, effective sample size. Next to it, the built-in
   torch engine on the same prompts and weights: `HFPolicy.generate()` vs `logprobs()` (routes
   replayed), which with the invariant kernels must be exactly 0 (the bench exits non-zero if not).
   Router agreement: vLLM returns routed experts only with Model Runner V2 (Triton, GPU), so on
   CPU it is "n/a"; for the built-in engine, the logged routes against the trainer's own routing
   of the same tokens (no replay).
2. **Update time.** `--updates` perturbed versions (tests/integration/rollout/stack.py `nudged`)
   loaded into the running vLLM in place (`VLLMEngine.update`: safetensors write, pause, reload,
   hash inside vLLM; each verified against `checkpoint_sha256`), against a full reload of the
   weights vLLM holds after them: a fresh vLLM server started from a copy of the model directory with those weights as
   model.safetensors (`--load-format safetensors`), timed from process start to /health. Both
   servers then sample the same seeded completions: the same tokens and log-probs show they hold
   the same weights. The updated server's completions are also scored by the trainer on the
   weights it now holds (a mismatch row) and on the original ones (far apart: the update took
   effect).
3. **Serving pause.** `pause_s` of the in-place updates (generation paused: no request is served),
   the drain (`/pause?mode=wait` while a request for 16 completions of 200 tokens is in flight: it
   waits for them to finish), and one update with such a request in flight (its pause includes
   the drain).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPTS = (
    "def add(a, b):",
    "import os\n",
    "class Replica:",
    "for i in range(",
    "The trainer reads",
    "# Numerics\n",
    "return self.",
    "x = torch.",
    "async def main():",
    "The replica serves",
    "with open(path) as f:",
    "if not ok:",
    "from pathlib import Path\n",
    "while True:",
    "raise ValueError(",
    "Kafka topics",
)
IN_FLIGHT = 16  # completions of the request in flight while generation pauses
PORTS = range(8850, 8870)  # the bench's own servers
ROUTES_NA = "n/a on CPU (vLLM returns routes only with Model Runner V2 on GPU)"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="moe", help="comma-separated: moe, dense")
    p.add_argument("--quick", action="store_true", help="8 prompts x 4 x 16 tokens, 2 updates")
    p.add_argument("--prompts", type=int, default=16, help="distinct prompts (<= 16)")
    p.add_argument("--samples", type=int, default=4, help="completions per prompt")
    p.add_argument("--tokens", type=int, default=32, help="tokens per completion")
    p.add_argument("--updates", type=int, default=3, help="in-place updates timed (median)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (trainer)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--workdir", type=Path, default=None, help="models and logs (default: a tmpdir)")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.samples, args.tokens, args.updates = 8, 4, 16, 2
    assert 1 <= args.prompts <= len(PROMPTS), f"--prompts must be in 1..{len(PROMPTS)}"
    return args


# ------------------------------------------------------------------ statistics (pure)


def logprob_gap(behaviour: Sequence[Sequence[float]], trainer: Sequence[Sequence[float]]) -> dict:
    """Per-token comparison of behaviour log-probs (the sampler's) with the trainer's on the same
    tokens, completions of any lengths. The tokens were sampled from the behaviour policy, so
    k1 = mean(lp_b - lp_t) and k3 = mean(r - 1 - log r), r = exp(lp_t - lp_b), both estimate
    KL(behaviour || trainer) (k3 >= 0 per token, lower variance). Values are compared as float32
    (what both sides log); differences are taken in float64, exactly."""
    import numpy as np

    assert len(behaviour) == len(trainer), f"{len(behaviour)} vs {len(trainer)} completions"
    for i, (b, t) in enumerate(zip(behaviour, trainer)):
        assert len(b) == len(t), f"completion {i}: {len(b)} behaviour vs {len(t)} trainer log-probs"
    b = np.array([x for row in behaviour for x in row], dtype=np.float32).astype(np.float64)
    t = np.array([x for row in trainer for x in row], dtype=np.float32).astype(np.float64)
    if b.size == 0:
        raise ValueError("no tokens to compare")
    d = b - t
    q = t - b  # log r
    return {
        "tokens": int(b.size),
        "max_abs": float(np.abs(d).max()),
        "mean_abs": float(np.abs(d).mean()),
        "frac_differ": float((d != 0).mean()),
        "frac_gt_1e-3": float((np.abs(d) > 1e-3).mean()),
        "kl_k1": float(d.mean()),
        "kl_k3": float((np.expm1(q) - q).mean()),
    }


def correction(
    behaviour: Sequence[Sequence[float]],
    trainer: Sequence[Sequence[float]],
    *,
    trunc_c: float = 2.0,
    mask_low: float = 0.5,
    mask_high: float = 2.0,
) -> dict:
    """What trainer/objective.py `importance_weights` makes of this gap (the trainer's own
    function): token ratios rho = exp(lp_t - lp_b) truncated at C, sequences masked when their
    geometric-mean ratio leaves [mask_low, mask_high]; with the extreme sequence ratios."""
    import torch

    from trainer.objective import importance_weights

    n, width = len(behaviour), max((len(r) for r in behaviour), default=0)
    lb, lt, mask = (torch.zeros((n, max(width, 1)), dtype=torch.float32) for _ in range(3))
    for i, (b, t) in enumerate(zip(behaviour, trainer)):
        assert len(b) == len(t), f"completion {i}: {len(b)} vs {len(t)} log-probs"
        lb[i, : len(b)] = torch.tensor(b, dtype=torch.float32)
        lt[i, : len(t)] = torch.tensor(t, dtype=torch.float32)
        mask[i, : len(b)] = 1.0
    w = importance_weights(lt, lb, mask, trunc_c=trunc_c, mask_low=mask_low, mask_high=mask_high)
    real = mask.sum(dim=1) > 0
    ratios = w.seq_ratio[real]
    return {
        "clip_fraction": w.clip_fraction,
        "masked_fraction": w.masked_fraction,
        "ess": w.ess,
        "seq_ratio_min": float(ratios.min()) if ratios.numel() else math.nan,
        "seq_ratio_max": float(ratios.max()) if ratios.numel() else math.nan,
    }


def route_agreement(logged: Sequence[Any], recomputed: Sequence[Any]) -> float:
    """Fraction of (token, MoE layer) pairs whose expert SET is the same in `logged` and
    `recomputed` (arrays [T, layers, top_k] per completion; the order within top-k is ignored)."""
    import numpy as np

    same = total = 0
    for i, (a, b) in enumerate(zip(logged, recomputed, strict=True)):
        a, b = np.sort(np.asarray(a), axis=-1), np.sort(np.asarray(b), axis=-1)
        assert a.shape == b.shape, f"completion {i}: routes {a.shape} vs {b.shape}"
        eq = (a == b).all(axis=-1)
        same, total = same + int(eq.sum()), total + int(eq.size)
    if total == 0:
        raise ValueError("no routes to compare")
    return same / total


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else math.nan


# ------------------------------------------------------------------ models


def build_model(kind: str, work: Path, tokenizer_dir: Path) -> Path:
    """A tiny HF model directory with head_dim 64 (what vLLM's CPU attention accepts)."""
    from tests.hf_models import tiny_llama_dir, tiny_qwen2_moe_dir

    if kind == "moe":
        return tiny_qwen2_moe_dir(work / "moe", tokenizer_dir, head_dim=64)
    if kind == "dense":
        return tiny_llama_dir(work / "dense", tokenizer_dir, head_dim=64)
    raise SystemExit(f"unknown --model {kind!r}: expected moe or dense")


def trainer_policy(model_dir: Path, state: dict, kernels: str):
    from policy import build_policy

    pol = build_policy({"type": "hf", "model_dir": str(model_dir), "kernels": kernels})
    pol.load_serving_state_dict(state)
    return pol.eval()


def trainer_logprobs(pol, prompts: list[list[int]], completions: list[list[int]]) -> list[list]:
    import torch

    with torch.no_grad():
        lp = pol.logprobs(prompts, completions, None, 1.0)
    return [lp[i, : len(c)].tolist() for i, c in enumerate(completions)]


def builtin_routes(pol, prompts: list[list[int]], completions: list[list[int]]) -> list[Any]:
    """The trainer's own routing (no replay) at the positions that predicted each completion
    token: one right-padded full forward, as `logprobs()` runs it."""
    import torch

    tok = pol.tokenizer
    seqs = [[tok.start_id, *p, *c] for p, c in zip(prompts, completions)]
    width = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), width), tok.pad_id, dtype=torch.int64)
    mask = torch.zeros((len(seqs), width), dtype=torch.int64)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    with torch.no_grad():
        _, routes = pol.forward_logits(tokens, mask, torch.arange(width).expand(len(seqs), width))
    return [
        routes[i, len(p) : len(p) + len(c)].numpy()
        for i, (p, c) in enumerate(zip(prompts, completions))
    ]


# ------------------------------------------------------------------ vLLM


def free_bench_port(taken: set[int]) -> int:
    for port in PORTS:
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise SystemExit(f"no free port in {PORTS.start}-{PORTS.stop - 1}")


def start_server(python: Path, model_dir: Path, port: int, log: Path, extra: list[str], say):
    """(server, seconds from process start to /health) of one vLLM server."""
    from app.replica.engines.vllm import VLLMServer

    t0 = time.perf_counter()
    srv = VLLMServer(
        python, model_dir, port=port, max_model_len=256, log_path=log, kv_cache_gib=1, extra=extra
    )
    stop = threading.Event()

    def progress() -> None:
        while not stop.wait(15):
            say(f"  … vLLM on :{port} still starting ({time.perf_counter() - t0:.0f} s)")

    threading.Thread(target=progress, daemon=True).start()
    try:
        srv.wait_ready(900)
    except BaseException:
        srv.stop()
        raise
    finally:
        stop.set()
    return srv, time.perf_counter() - t0


def sample_vllm(engine, start_id: int, prompts: list[list[int]], n: int, tokens: int, seed: int):
    """n completions per prompt (one request per prompt, `n` children with seeds seed + i)."""
    out_p, out_c, out_lp = [], [], []
    for k, p in enumerate(prompts):
        toks, lps, _, _ = engine.generate(
            [[start_id, *p]] * n,
            max_tokens=tokens,
            temperature=1.0,
            seed=seed + 1000 * k,
            on_step=None,
        )
        for t, lp in zip(toks, lps):
            out_p.append(p)
            out_c.append(t)
            out_lp.append(lp)
    return out_p, out_c, out_lp


def long_request(url: str, start_id: int, prompt: list[int], first: threading.Event) -> dict:
    """A streamed request for IN_FLIGHT completions of 200 tokens each (ignore_eos): sets `first`
    at its first token; returns {ok, tokens, end} (end: perf_counter when the stream closed).
    Tokens are counted from `token_ids`: vLLM merges a slow reader's pending tokens into one
    chunk."""
    import httpx

    from app.replica.engines.vllm import SERVED_NAME

    body = {
        "model": SERVED_NAME,
        "prompt": [start_id, *prompt],
        "n": IN_FLIGHT,
        "max_tokens": 200,
        "temperature": 1.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    got = [0] * IN_FLIGHT
    reasons: list[str | None] = [None] * IN_FLIGHT
    ok = False
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for ch in json.loads(line[6:]).get("choices", []):
                        got[ch["index"]] += len(ch.get("token_ids") or [])
                        reasons[ch["index"]] = ch.get("finish_reason") or reasons[ch["index"]]
                    first.set()
            ok = r.status_code == 200
    finally:
        first.set()
    return {
        "ok": ok and got == [200] * IN_FLIGHT and reasons == ["length"] * IN_FLIGHT,
        "tokens": sum(got),
        "end": time.perf_counter(),
    }


def with_request_in_flight(engine, start_id: int, prompt: list[int], action) -> tuple[Any, dict]:
    """Run `action()` while a request of IN_FLIGHT x 200 tokens streams (from its first token on);
    (its result, the request's outcome: `after_action_start_s` = when it ended, from the action's
    start)."""
    first = threading.Event()
    box: dict = {}

    def run() -> None:
        try:
            box.update(long_request(engine.url, start_id, prompt, first))
        except Exception as exc:  # reported as not ok
            box.update(ok=False, error=f"{type(exc).__name__}: {exc}", end=time.perf_counter())

    th = threading.Thread(target=run)
    th.start()
    first.wait(300)
    t0 = time.perf_counter()
    try:
        result = action()
    finally:
        th.join(600)
    box["after_action_start_s"] = box.pop("end", t0) - t0
    return result, box


def full_reload_dir(model_dir: Path, state: dict, out: Path) -> Path:
    """A copy of the model directory whose model.safetensors holds `state` (bf16)."""
    from safetensors.torch import save_file

    shutil.copytree(model_dir, out)
    for f in out.glob("*.safetensors"):
        f.unlink()
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        str(out / "model.safetensors"),
        {"format": "pt"},
    )
    return out


# ------------------------------------------------------------------ one model


@dataclass
class Run:
    """One model's measurements: its files, the shipped state, prompts and where to write."""

    kind: str
    args: argparse.Namespace
    model_dir: Path
    state: dict  # bf16 serving state, checkpoint names: what a version ships
    start_id: int
    prompts: list[list[int]]
    work: Path
    say: Any

    def gap_row(self, engine: str, kernels: str, behav: list, trainer: list) -> dict:
        return {
            "engine": engine,
            "kernels": kernels,
            **logprob_gap(behav, trainer),
            **correction(behav, trainer),
        }


def measure_vllm_mismatch(run: Run, engine) -> list[dict]:
    """vLLM's samples and behaviour log-probs, scored by the trainer with each kernel set."""
    a = run.args
    run.say(f"[{run.kind}] sampling {a.prompts} x {a.samples} x {a.tokens} tokens from vLLM…")
    ps, cs, behav = sample_vllm(engine, run.start_id, run.prompts, a.samples, a.tokens, 0)
    rows = []
    for kernels in ("default", "invariant"):
        run.say(f"[{run.kind}] trainer log-probs, kernels {kernels}…")
        lt = trainer_logprobs(trainer_policy(run.model_dir, run.state, kernels), ps, cs)
        rows.append(run.gap_row("vllm", kernels, behav, lt))
    return rows


def measure_builtin(run: Run) -> tuple[list[dict], float | str]:
    """The built-in engine on the same prompts and weights: generate() vs logprobs() (routes
    replayed) per kernel set, and (MoE) the logged routes against the trainer's own routing."""
    import torch

    run.say(f"[{run.kind}] built-in engine: generate() vs logprobs(), both kernel sets…")
    pol = trainer_policy(run.model_dir, run.state, "invariant")
    rep = [p for p in run.prompts for _ in range(run.args.samples)]
    rows, agree = [], "dense model"
    for kernels in ("default", "invariant"):
        pol.set_kernels(kernels)
        samples = pol.generate(rep, run.args.tokens, temperature=1.0, seed=0)
        comps = [s.tokens for s in samples]
        routes = [s.routes for s in samples] if pol.moe_spec else None
        with torch.no_grad():
            lp = pol.logprobs(rep, comps, routes, 1.0)
        lt = [lp[i, : len(c)].tolist() for i, c in enumerate(comps)]
        rows.append(run.gap_row("torch", kernels, [s.logprobs for s in samples], lt))
        if kernels == "invariant" and routes is not None:
            agree = route_agreement(routes, builtin_routes(pol, rep, comps))
    return rows, agree


def measure_updates(run: Run, engine) -> list[dict]:
    """`--updates` nudged versions loaded in place, each verified by the hash inside vLLM."""
    from kernels.delta.hashing import checkpoint_sha256
    from tests.integration.rollout.stack import nudged

    out = []
    for i in range(run.args.updates):
        version = nudged(run.state, seed=i + 1)
        run.say(f"[{run.kind}] in-place update {i + 1}/{run.args.updates}…")
        rep = engine.update(version, run.work / "transfer")
        out.append(
            {
                "write_s": rep["write_s"],
                "pause_s": rep["pause_s"],
                **{f"{k}_s": v for k, v in rep["seconds"].items()},
                "verified": rep["sha256"] == checkpoint_sha256(version) and not rep["missing"],
            }
        )
    return out


def measure_pause(run: Run, engine, updates: list[dict]) -> tuple[dict, dict]:
    """(the pause figures, the state vLLM holds afterwards): the drain of /pause?mode=wait with a
    request in flight, and one update with a request in flight."""
    from kernels.delta.hashing import checkpoint_sha256
    from tests.integration.rollout.stack import nudged

    run.say(f"[{run.kind}] drain: /pause?mode=wait with {IN_FLIGHT} x 200 tokens in flight…")

    def pause_resume() -> float:
        t = time.perf_counter()
        engine.post("/pause", mode="wait")
        d = time.perf_counter() - t
        engine.post("/resume")
        return d

    drain_s, drained = with_request_in_flight(engine, run.start_id, run.prompts[0], pause_resume)
    run.say(f"[{run.kind}] an in-place update with {IN_FLIGHT} x 200 tokens in flight…")
    loaded = nudged(run.state, seed=99)
    up, during = with_request_in_flight(
        engine, run.start_id, run.prompts[1], lambda: engine.update(loaded, run.work / "transfer")
    )
    figures = {
        "pause_s_median": median([u["pause_s"] for u in updates]),
        "drain_s": drain_s,
        "drain_request": drained,
        "loaded_update_pause_s": up["pause_s"],
        "loaded_update_verified": up["sha256"] == checkpoint_sha256(loaded),
        "loaded_request": during,
    }
    return figures, loaded


def measure_reload(
    run: Run, python: Path, held: dict, ref: tuple, port: int, updates: list[dict]
) -> dict:
    """A fresh server started from the weights vLLM `held` (full reload): its start time, and
    the same seeded completions as `ref` (prompts, tokens, log-probs) from the updated server."""
    from app.replica.engines.vllm import VLLMEngine

    a = run.args
    run.say(f"[{run.kind}] full reload: a fresh vLLM server loading the same weights…")
    reload_dir = full_reload_dir(run.model_dir, held, run.work / f"{run.kind}-reload")
    srv, t_full = start_server(
        python,
        reload_dir,
        port,
        run.work / f"vllm-{run.kind}-reload.log",
        ["--load-format", "safetensors"],  # after server_args' dummy: the last one wins
        run.say,
    )
    try:
        fresh = VLLMEngine(1, srv.url, srv)
        _, f_c, f_lp = sample_vllm(fresh, run.start_id, run.prompts, a.samples, a.tokens, 7)
    finally:
        srv.stop()
    _, ref_c, ref_lp = ref
    same = f_c == ref_c
    diff = max(abs(x - y) for r, s in zip(f_lp, ref_lp) for x, y in zip(r, s)) if same else math.nan
    in_place = median([u["write_s"] + u["pause_s"] for u in updates])
    return {
        "full_reload_s": t_full,
        "in_place_s": in_place,
        "ratio_full_over_in_place": t_full / in_place,
        "same_tokens": same,
        "max_abs_logprob_diff": diff,
    }


def run_model(kind: str, args: argparse.Namespace, python: Path, work: Path, tok_dir: Path, say):
    """Every measurement of one model, on one vLLM server (stopped in `finally`) and then a
    fresh one for the full reload."""
    from app.replica.engines.vllm import VLLMEngine
    from kernels.delta.hashing import checkpoint_sha256
    from policy import build_policy

    model_dir = build_model(kind, work, tok_dir)
    base = build_policy({"type": "hf", "model_dir": str(model_dir), "kernels": "default"})
    state = base.serving_state_dict()
    n_params = sum(p.numel() for p in base.parameters())
    tok = base.tokenizer
    prompts = [tok.encode(t) for t in PROMPTS[: args.prompts]]
    run = Run(kind, args, model_dir, state, tok.start_id, prompts, work, say)
    res: dict[str, Any] = {"params": n_params, "model_dir": str(model_dir)}
    say(f"[{kind}] {n_params / 1e6:.2f}M parameters; starting vLLM (load-format dummy)…")
    taken: set[int] = set()
    srv, t_start = start_server(
        python, model_dir, free_bench_port(taken), work / f"vllm-{kind}.log", [], say
    )
    try:
        engine = VLLMEngine(0, srv.url, srv)
        res["server_start_dummy_s"] = t_start
        say(f"[{kind}] vLLM ready in {t_start:.1f} s; first load (with the probe)…")
        first = engine.update(state, work / "transfer")
        assert first["sha256"] == checkpoint_sha256(state), f"vLLM holds other weights: {first}"
        res["first_load"] = {k: first[k] for k in ("seconds", "pause_s", "write_s")}
        res["mismatch"] = measure_vllm_mismatch(run, engine)
        builtin, agree = measure_builtin(run)
        res["mismatch"] += builtin
        res["routes"] = {"vllm": ROUTES_NA if agree != "dense model" else agree, "torch": agree}
        res["updates"] = measure_updates(run, engine)
        res["pause"], held = measure_pause(run, engine, res["updates"])
        say(f"[{kind}] seeded completions from the updated server, scored by the trainer…")
        ref = sample_vllm(engine, tok.start_id, prompts, args.samples, args.tokens, 7)
        lt = trainer_logprobs(trainer_policy(model_dir, held, "default"), ref[0], ref[1])
        res["mismatch"].append(run.gap_row("vllm (after in-place update)", "default", ref[2], lt))
        old = trainer_logprobs(trainer_policy(model_dir, state, "default"), ref[0], ref[1])
        res["stale_weights_gap"] = logprob_gap(ref[2], old)
    finally:
        srv.stop()
    res["reload"] = measure_reload(run, python, held, ref, free_bench_port(taken), res["updates"])
    return res


# ------------------------------------------------------------------ report


def fmt(x: Any, spec: str = ".3g") -> str:
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return "nan" if math.isnan(x) else format(x, spec)
    return str(x)


def report(results: dict[str, dict], console) -> list[str]:
    """Print the tables; returns the failures (a built-in invariant row that is not exactly 0,
    an update that did not verify, a request that did not complete)."""
    from rich.table import Table

    failures: list[str] = []
    mis = Table(title="behaviour log-probs vs the trainer's on the same bf16 weights (T = 1)")
    cols = (
        "model", "engine", "trainer kernels", "tokens", "max |Δ|", "mean |Δ|", "differ",
        "|Δ|>1e-3", "KL k1", "KL k3", "clipped ρ>2", "masked seqs", "seq ratio min-max", "ESS",
    )  # fmt: skip
    for c in cols:
        mis.add_column(c, justify="right")
    for kind, r in results.items():
        for m in r["mismatch"]:
            mis.add_row(
                kind, m["engine"], m["kernels"], str(m["tokens"]), fmt(m["max_abs"]),
                fmt(m["mean_abs"]), f"{m['frac_differ']:.1%}", f"{m['frac_gt_1e-3']:.1%}",
                fmt(m["kl_k1"], ".2e"), fmt(m["kl_k3"], ".2e"), f"{m['clip_fraction']:.1%}",
                f"{m['masked_fraction']:.1%}",
                f"{m['seq_ratio_min']:.3f}-{m['seq_ratio_max']:.3f}", f"{m['ess']:.4f}",
            )  # fmt: skip
            if m["engine"] == "torch" and m["kernels"] == "invariant" and m["max_abs"] != 0:
                failures.append(
                    f"{kind}: built-in invariant max |Δ| {m['max_abs']:.3g} (must be 0)"
                )
    console.print(mis)
    for kind, r in results.items():
        st = r["stale_weights_gap"]
        console.print(
            f"{kind}: the post-update completions against the ORIGINAL weights: mean |Δ| "
            f"{st['mean_abs']:.3g}, KL k3 {st['kl_k3']:.2e} (the update took effect inside vLLM)"
        )
        a = r["routes"]["torch"]
        console.print(
            f"{kind}: router agreement: vLLM {r['routes']['vllm']}; built-in engine (invariant): "
            + (f"{a:.1%} of (token, layer) expert sets" if isinstance(a, float) else str(a))
        )
        if isinstance(a, float) and a != 1.0:
            failures.append(f"{kind}: built-in route agreement {a:.3%} (must be 100%)")
    upd = Table(
        title="update time: in place (VLLMEngine.update) vs a full reload of the same weights"
    )
    cols = (
        "model", "server start (dummy)", "first load (probe)", "in place: write", "pause",
        "of which load", "hash", "write+pause", "full reload (fresh server)", "full / in place",
        "same completions",
    )  # fmt: skip
    for c in cols:
        upd.add_column(c, justify="right")
    for kind, r in results.items():
        us, fl, rl = r["updates"], r["first_load"], r["reload"]
        upd.add_row(
            kind, f"{r['server_start_dummy_s']:.1f} s",
            f"{fl['seconds']['probe']:.2f} s",
            f"{median([u['write_s'] for u in us]):.3f} s",
            f"{median([u['pause_s'] for u in us]):.3f} s",
            f"{median([u['load_s'] for u in us]):.3f} s",
            f"{median([u['hash_s'] for u in us]):.3f} s",
            f"{rl['in_place_s']:.3f} s", f"{rl['full_reload_s']:.1f} s",
            f"{rl['ratio_full_over_in_place']:.0f}x",
            "yes, max |Δlp| " + fmt(rl["max_abs_logprob_diff"]) if rl["same_tokens"] else "NO",
        )  # fmt: skip
        failures += [
            f"{kind}: in-place update {i + 1} not verified"
            for i, u in enumerate(us)
            if not u["verified"]
        ]
    console.print(upd)
    pause = Table(title="serving pause (no request is served while generation is paused)")
    for c in ("model", "update pause (median)",
              f"drain: /pause?mode=wait, {IN_FLIGHT} x 200 tokens in flight",
              "… the request ended after", "update with them in flight: pause",
              "… the request ended after", "in-flight requests completed"):  # fmt: skip
        pause.add_column(c, justify="right")
    for kind, r in results.items():
        p = r["pause"]
        d, u = p["drain_request"], p["loaded_request"]
        ok = bool(d.get("ok")) and bool(u.get("ok"))
        pause.add_row(
            kind, f"{p['pause_s_median']:.3f} s", f"{p['drain_s']:.3f} s",
            f"{d.get('after_action_start_s', math.nan):.3f} s",
            f"{p['loaded_update_pause_s']:.3f} s",
            f"{u.get('after_action_start_s', math.nan):.3f} s",
            f"yes ({IN_FLIGHT} x 200 tokens each)" if ok else "NO",
        )  # fmt: skip
        if not ok:
            failures.append(f"{kind}: an in-flight request failed: {p}")
        if not p["loaded_update_verified"]:
            failures.append(f"{kind}: the update under load did not verify")
    console.print(pause)
    return failures


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    import os

    import torch
    from rich.console import Console
    from rich.markup import escape

    from app.replica.engines.vllm import provision_python
    from tests.hf_models import train_bpe_tokenizer

    torch.set_num_threads(args.threads)
    # SIGTERM (timeout, kill) unwinds like an exception: the `finally`s stop the vLLM servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    console = Console(width=200)
    t_begin = time.perf_counter()

    def say(msg: str) -> None:
        console.print(f"[dim]{time.perf_counter() - t_begin:6.1f} s[/] {escape(msg)}")

    owned = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="flywheel-mismatch-")) if owned else args.workdir
    work.mkdir(parents=True, exist_ok=True)
    try:
        say("vLLM environment (deploy/vllm/ensure.sh)…")
        python = provision_python()
        tok_dir = train_bpe_tokenizer(work / "tokenizer")
        results = {
            kind: run_model(kind, args, python, work, tok_dir, say)
            for kind in args.model.split(",")
        }
    finally:
        if owned:
            shutil.rmtree(work, ignore_errors=True)
    failures = report(results, console)
    if args.json is not None:
        doc = {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "cpus": os.cpu_count(),
            "models": results,
            "failures": failures,
        }
        args.json.write_text(json.dumps(doc, indent=2, default=str))
        say(f"wrote {args.json}")
    if failures:
        console.print("[red bold]FAILED:[/]")
        for f in failures:
            console.print(f"  {f}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
