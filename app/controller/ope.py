"""Off-policy estimates of a new policy's reward on logged rollouts (the gate's main number).

Every logged rollout carries the behaviour log-probs of its completion (logged by the replica
that generated it), so a sequence-level importance weight of a new policy is

    w_i = exp( sum_t log pi_new(a_it | x_i, a_i<t) - sum_t log mu(a_it | ...) )

Estimators (all in float64; weights are handled in log space and self-normalised, so the
constant exp(max log w) cancels and nothing overflows):

- SNIPS: sum_i w_i r_i / sum_i w_i.
- Doubly robust (self-normalised): mean_j v_hat(x_j) + sum_i w_i (r_i - q_hat(x_i, a_i)) / sum_i w_i,
  with q_hat a ridge regression of reward on cheap features of (context, completion) and
  v_hat(x_j) = q_hat on the new policy's own completion for context j (the direct-method term).
- Effective sample size (sum w)^2 / sum w^2: how many logged samples the estimate really rests on.
- Percentile bootstrap intervals, resampling contexts (seeded, `n_boot` replicates).

References: Swaminathan & Joachims 2015 (SNIPS); Dudik, Langford & Li 2011 (DR).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

F64 = np.float64


def sequence_log_weights(
    new_logprobs: Sequence[Sequence[float]], behaviour_logprobs: Sequence[Sequence[float]]
) -> np.ndarray:
    """log w_i = sum_t (new - behaviour), float64 [N]. Lengths must match per sequence."""
    out = np.empty(len(new_logprobs), dtype=F64)
    for i, (a, b) in enumerate(zip(new_logprobs, behaviour_logprobs, strict=True)):
        a64, b64 = np.asarray(a, dtype=F64), np.asarray(b, dtype=F64)
        assert a64.shape == b64.shape, (
            f"sequence {i}: {a64.shape} new log-probs vs {b64.shape} behaviour log-probs"
        )
        out[i] = float(np.sum(a64 - b64))
    return out


def normalized_weights(log_w: np.ndarray) -> np.ndarray:
    """w_i / sum w, computed stably from log weights. float64 [N]."""
    log_w = np.asarray(log_w, dtype=F64)
    assert log_w.ndim == 1 and log_w.size > 0, (
        f"need a non-empty 1-D array of log weights, got shape {log_w.shape}"
    )
    assert np.all(np.isfinite(log_w)), (
        f"log weights must be finite, got {log_w[~np.isfinite(log_w)][:5]}"
    )
    w = np.exp(log_w - log_w.max())
    return w / w.sum()


def snips(rewards: np.ndarray, log_w: np.ndarray) -> float:
    return float(np.dot(normalized_weights(log_w), np.asarray(rewards, dtype=F64)))


def doubly_robust(
    rewards: np.ndarray, log_w: np.ndarray, q_logged: np.ndarray, v_target: np.ndarray
) -> float:
    """Self-normalised DR: DM term on the new policy's completions + weighted residual correction."""
    resid = np.asarray(rewards, dtype=F64) - np.asarray(q_logged, dtype=F64)
    return float(
        np.mean(np.asarray(v_target, dtype=F64)) + np.dot(normalized_weights(log_w), resid)
    )


def effective_sample_size(log_w: np.ndarray) -> float:
    w = normalized_weights(log_w)
    return float(1.0 / np.sum(w * w))


def bootstrap_ci(
    stat: Callable[[np.ndarray], float],
    n: int,
    n_boot: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile interval of `stat(indices)` over `n_boot` resamples of range(n) with replacement."""
    assert n > 0 and n_boot > 0 and 0 < alpha < 1, f"n={n} n_boot={n_boot} alpha={alpha}"
    rng = np.random.default_rng(seed)
    vals = np.array([stat(rng.integers(0, n, size=n)) for _ in range(n_boot)], dtype=F64)
    return float(np.quantile(vals, alpha / 2)), float(np.quantile(vals, 1 - alpha / 2))


class RidgeRewardModel:
    """q_hat(x, a) = features @ beta, closed-form ridge (intercept not penalised)."""

    def __init__(self, lam: float = 1.0):
        assert lam >= 0, f"ridge lambda must be >= 0, got {lam}"
        self.lam, self.beta = lam, None

    def fit(self, X: np.ndarray, y: np.ndarray) -> RidgeRewardModel:
        X, y = np.asarray(X, dtype=F64), np.asarray(y, dtype=F64)
        assert X.ndim == 2 and X.shape[0] == y.shape[0], f"X {X.shape} vs y {y.shape}"
        penalty = self.lam * np.eye(X.shape[1], dtype=F64)
        penalty[0, 0] = 0.0  # column 0 is the intercept
        self.beta = np.linalg.solve(X.T @ X + penalty, X.T @ y)
        return self

    def predict(self, X: np.ndarray) -> np.ndarray:
        assert self.beta is not None, "fit the reward model first"
        return np.asarray(X, dtype=F64) @ self.beta


def completion_features(
    prompt_len: int, completion: Sequence[int], eos_id: int | None = None
) -> np.ndarray:
    """Cheap features of one (context, completion): [1, len/64, empty, ends with eos, prompt_len/256]."""
    n = len(completion)
    ends = float(n > 0 and eos_id is not None and completion[-1] == eos_id)
    return np.array(
        [1.0, n / 64.0, float(n == 0 or (n == 1 and ends)), ends, prompt_len / 256.0], dtype=F64
    )


@dataclass
class OpeResult:
    n: int
    behaviour_value: float  # mean logged reward (on-policy value of the logging policies)
    snips: float
    snips_ci: tuple[float, float]
    dr: float | None
    dr_ci: tuple[float, float] | None
    improvement_ci: tuple[float, float]  # (DR or SNIPS) - behaviour value, paired bootstrap
    ess: float
    max_weight: float  # largest normalised weight

    def as_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


def estimate(
    rewards: np.ndarray,
    log_w: np.ndarray,
    q_logged: np.ndarray | None = None,
    v_target: np.ndarray | None = None,
    n_boot: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
) -> OpeResult:
    """SNIPS (and DR when a reward model's predictions are given) with bootstrap intervals.

    `v_target[i]` must belong to the same context as `rewards[i]` (the new policy's completion
    for that logged prompt), so contexts are resampled jointly.
    """
    r = np.asarray(rewards, dtype=F64)
    lw = np.asarray(log_w, dtype=F64)
    n = r.shape[0]
    assert lw.shape == (n,), f"{lw.shape} log weights for {n} rewards"
    use_dr = q_logged is not None and v_target is not None

    def point(idx: np.ndarray) -> float:
        if use_dr:
            return doubly_robust(r[idx], lw[idx], q_logged[idx], v_target[idx])
        return snips(r[idx], lw[idx])

    all_idx = np.arange(n)
    sn = snips(r, lw)
    snips_ci = bootstrap_ci(lambda i: snips(r[i], lw[i]), n, n_boot, alpha, seed)
    dr = point(all_idx) if use_dr else None
    dr_ci = bootstrap_ci(point, n, n_boot, alpha, seed) if use_dr else None
    imp_ci = bootstrap_ci(lambda i: point(i) - float(np.mean(r[i])), n, n_boot, alpha, seed)
    return OpeResult(
        n=n,
        behaviour_value=float(r.mean()),
        snips=sn,
        snips_ci=snips_ci,
        dr=dr,
        dr_ci=dr_ci,
        improvement_ci=imp_ci,
        ess=effective_sample_size(lw),
        max_weight=float(normalized_weights(lw).max()),
    )


# --- the reward model of the direct method --------------------------------------------------
PREFIX_BYTES = 12  # prefixes of the stripped completion up to this many bytes are features
HASH_BUCKETS = 512  # buckets of each hashed feature family
N_TEXT_FEATURES = 5 + HASH_BUCKETS + 256 + HASH_BUCKETS


def _bucket(family: str, key: bytes) -> int:
    return zlib.crc32(family.encode() + b"\0" + key) % HASH_BUCKETS


def text_features(text: str) -> np.ndarray:
    """Features of one completion's text that a reward model can learn user taste from, without
    knowing it: [1, bytes/64, lines/8, empty, one line] + hashed prefixes of the stripped text
    (how it starts: `return`, `if`, `#`, ...) + the share of each byte value + a hashed bag of byte
    3-grams (what it contains), normalised by the number of 3-grams. Stable hashes (crc32),
    float64 [N_TEXT_FEATURES]."""
    body = text.strip().encode("utf-8", "replace")
    lines = body.count(b"\n") + 1 if body else 0
    head = np.array(
        [1.0, len(body) / 64.0, min(lines, 8) / 8.0, float(not body), float(lines == 1)], dtype=F64
    )
    prefix = np.zeros(HASH_BUCKETS, dtype=F64)
    for k in range(1, min(len(body), PREFIX_BYTES) + 1):
        prefix[_bucket("prefix", body[:k])] = 1.0
    unigrams = np.bincount(np.frombuffer(body, dtype=np.uint8), minlength=256).astype(F64) / max(
        len(body), 1
    )
    grams = np.zeros(HASH_BUCKETS, dtype=F64)
    n3 = max(len(body) - 2, 0)
    for i in range(n3):
        grams[_bucket("3gram", body[i : i + 3])] += 1.0 / n3
    return np.concatenate([head, prefix, unigrams, grams])


class TextRewardModel:
    """A ridge regression of logged reward on `text_features` of the completion: the gate's
    direct-method estimate of what users would make of a completion it has not shown anyone.

    `cv_r2` (k-fold cross-validated R^2) says how much of the reward the features explain on
    rollouts the fit did not see: near 0, the model sees no taste and its comparisons are noise.
    """

    def __init__(self, lam: float = 3.0):
        self.ridge = RidgeRewardModel(lam)
        self.n, self.cv_r2 = 0, float("nan")

    @staticmethod
    def featurize(texts: Sequence[str]) -> np.ndarray:
        return (
            np.stack([text_features(t) for t in texts]) if texts else np.zeros((0, N_TEXT_FEATURES))
        )

    def fit(
        self, texts: Sequence[str], rewards: Sequence[float], folds: int = 5, seed: int = 0
    ) -> TextRewardModel:
        X, y = self.featurize(texts), np.asarray(rewards, dtype=F64)
        assert X.shape[0] == y.shape[0] and y.size >= 2, (
            f"{X.shape[0]} texts vs {y.size} rewards (need >= 2)"
        )
        self.n = int(y.size)
        if y.size >= 2 * folds:
            order = np.random.default_rng(seed).permutation(y.size)
            pred = np.empty_like(y)
            for f in range(folds):
                test = order[f::folds]
                train = np.setdiff1d(order, test)
                pred[test] = (
                    RidgeRewardModel(self.ridge.lam).fit(X[train], y[train]).predict(X[test])
                )
            ss = float(np.sum((y - y.mean()) ** 2))
            self.cv_r2 = 1.0 - float(np.sum((y - pred) ** 2)) / ss if ss > 0 else float("nan")
        self.ridge.fit(X, y)
        return self

    def predict(self, texts: Sequence[str]) -> np.ndarray:
        return self.ridge.predict(self.featurize(texts))


def paired_difference(
    cand: np.ndarray, champ: np.ndarray, n_boot: int = 1000, alpha: float = 0.05, seed: int = 0
) -> tuple[float, tuple[float, float]]:
    """Mean over prompts of (candidate - champion) predicted reward, [P, K] arrays of K samples per
    prompt each, and its percentile bootstrap interval resampling prompts (the samples of one prompt
    stay together, so the pairing by prompt and by random stream is kept)."""
    c, h = np.asarray(cand, dtype=F64), np.asarray(champ, dtype=F64)
    assert c.shape == h.shape and c.ndim == 2 and c.shape[0] > 0, (
        f"candidate {c.shape} vs champion {h.shape}"
    )
    d = c.mean(axis=1) - h.mean(axis=1)
    return float(d.mean()), bootstrap_ci(lambda i: float(d[i].mean()), d.size, n_boot, alpha, seed)
