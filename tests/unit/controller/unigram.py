"""A tiny real Policy for gate tests: tokens drawn i.i.d. from softmax(logits / T), ignoring context.

Small enough to reason about by hand: log pi(a) is the same at every position, so sequence
importance weights and KL values have closed forms.
"""

from __future__ import annotations

import torch

from policy.base import Policy, Sample, Tokenizer


class ByteTok(Tokenizer):
    name, vocab_size, eos_id = "byte-v1", 257, 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, tokens: list[int]) -> str:
        return bytes(t for t in tokens if t < 256).decode(errors="replace")


class UnigramPolicy(Policy):
    def __init__(self, logits: torch.Tensor | None = None):
        super().__init__()
        self.tokenizer = ByteTok()
        self.logits = torch.nn.Parameter(
            logits if logits is not None else torch.zeros(257, dtype=torch.float32)
        )

    def _logp(self, temperature: float) -> torch.Tensor:
        return torch.log_softmax(self.logits / max(temperature, 1e-6), dim=-1)

    def generate(self, prompts, max_tokens, temperature=1.0, seed=None, on_step=None):
        g = torch.Generator().manual_seed(seed or 0)
        lp = self._logp(temperature).detach()
        rows = []
        for _ in prompts:  # row by row (the draw order fixes what a seed samples)
            toks = []
            for _ in range(max_tokens):
                t = int(torch.multinomial(lp.exp(), 1, generator=g))
                toks.append(t)
                if t == self.tokenizer.eos_id:
                    break
            rows.append(toks)
        if on_step is not None:  # context is ignored, so replaying the rows step by step is exact
            for step in range(max(map(len, rows), default=0)):
                if not on_step(step, [r[step] if step < len(r) else None for r in rows]):
                    rows = [r[: step + 1] for r in rows]
                    break
        return [Sample(tokens=r, logprobs=[float(lp[t]) for t in r]) for r in rows]

    def logprobs(self, prompt_tokens, completion_tokens, routes=None, temperature=1.0):
        lp = self._logp(temperature)
        T = max([len(c) for c in completion_tokens] + [1])
        out = torch.zeros(len(completion_tokens), T, dtype=torch.float32)
        for i, c in enumerate(completion_tokens):
            if c:
                out[i, : len(c)] = lp[torch.tensor(c)]
        return out

    def serving_state_dict(self):
        return {"logits": self.logits.detach().to(torch.bfloat16)}

    def load_serving_state_dict(self, state):
        self.logits.data.copy_(state["logits"].to(torch.float32))

    def config_dict(self):
        return {"kind": "unigram"}


def favouring(tokens: list[int], strength: float) -> UnigramPolicy:
    logits = torch.zeros(257, dtype=torch.float32)
    logits[torch.tensor(tokens)] = strength
    return UnigramPolicy(logits)
