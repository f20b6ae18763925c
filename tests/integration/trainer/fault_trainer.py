"""`python -m tests.integration.trainer.fault_trainer`: `flywheel trainer` with a fault injected into its forward.

Test-only launcher. The policy's `logprobs` raises RuntimeError("injected fault ...") whenever a
prompt contains the bytes of `FLYWHEEL_TEST_FAULT_MARK`: a valid rollout the forward cannot
take, standing in for a failure no validation foresaw. Everything else is the real
`trainer.launch.main()`.
"""

from __future__ import annotations

import logging
import os

from policy.moe_lm import MoEPolicy
from policy.tokenizer import ByteTokenizer

MARK = ByteTokenizer().encode(os.environ.get("FLYWHEEL_TEST_FAULT_MARK", "#STEP-FAULT#"))
_real_logprobs = MoEPolicy.logprobs


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def _faulty_logprobs(self, prompt_tokens, completion_tokens, routes=None, temperature=1.0):
    if any(_contains(list(p), MARK) for p in prompt_tokens):
        raise RuntimeError("injected fault: the forward cannot take this rollout")
    return _real_logprobs(self, prompt_tokens, completion_tokens, routes, temperature)


MoEPolicy.logprobs = _faulty_logprobs

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from trainer.launch import main

    main()
