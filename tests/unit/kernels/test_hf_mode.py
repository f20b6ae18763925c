"""batch_invariant_mode on Hugging Face causal LMs: tiny random Llama (dense) and Qwen2-MoE
(fused experts) built from configs. Inside the mode a KV-cache decode equals the full forward
and a sequence alone equals itself in a padded batch, bit for bit; outside the mode they do not;
backward stays correct; every op the models dispatch is covered or on the exact allow-list."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

from kernels import exact_matmul, hf_mode
from kernels import invariant as inv
from kernels.exact_matmul import K_MAX, exact_bmm
from kernels.hf_mode import batch_invariant_mode, classify, in_backward
from kernels.logprobs import log_probs

VOCAB = 300
LENGTHS = (11, 5, 16, 8)  # a batch of 4 different lengths; sequence 0 is the one checked alone
COMMON = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "intermediate_size": 128,
    "max_position_embeddings": 128,
}
# (model family, attention implementation, MoE experts implementation)
MODELS = {
    "llama-eager": ("llama", "eager", None),
    "llama-sdpa": ("llama", "sdpa", None),
    "moe-eager": ("moe", "eager", "grouped_mm"),  # transformers' default experts path on CPU
    "moe-sdpa": ("moe", "sdpa", "grouped_mm"),
    "moe-eager-experts-loop": ("moe", "eager", "eager"),  # per-expert loop + index_add_
    "moe-batched-mm": ("moe", "eager", "batched_mm"),
}


def tiny_model(name: str, seed: int = 0) -> torch.nn.Module:
    family, attn, experts = MODELS[name]
    torch.manual_seed(seed)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**COMMON, attn_implementation=attn)).eval()
    config = Qwen2MoeConfig(
        **COMMON,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        attn_implementation=attn,
        experts_implementation=experts,
    )
    return Qwen2MoeForCausalLM(config).eval()


def _seqs(seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def _incremental(model, seq: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] from a decode of one token at a time over HF's DynamicCache."""
    cache, rows = DynamicCache(config=model.config), []
    for t in range(len(seq)):
        out = model(input_ids=seq[None, t : t + 1], past_key_values=cache, use_cache=True)
        rows.append(out.logits[0, -1])
    return torch.stack(rows)


def _batched(model, seqs: list[torch.Tensor], side: str) -> list[torch.Tensor]:
    """Each sequence's logits [T_i, V] from one padded batch forward (attention_mask; for left
    padding position_ids from the mask, as HF generate() does)."""
    t_max = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), t_max, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        where = slice(0, len(s)) if side == "right" else slice(t_max - len(s), t_max)
        ids[i, where], mask[i, where] = s, 1
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    return [
        logits[i, : len(s)] if side == "right" else logits[i, t_max - len(s) :]
        for i, s in enumerate(seqs)
    ]


@pytest.mark.parametrize("name", list(MODELS))
def test_kv_cache_decode_equals_full_forward_bit_for_bit_inside_the_mode(name):
    model, seq = tiny_model(name), _seqs()[0]
    with torch.no_grad(), batch_invariant_mode():
        full = model(input_ids=seq[None]).logits[0]
        step = _incremental(model, seq)
        gen = model.generate(
            seq[None, :6],
            max_new_tokens=6,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        regen = model(input_ids=gen.sequences).logits[0]
    for t in range(len(seq)):
        assert torch.equal(step[t], full[t]), (
            f"{name}: decode step {t} differs by {(step[t] - full[t]).abs().max().item():.3g}"
        )
    for j, row in enumerate(gen.logits):  # HF generate()'s own cache loop
        assert torch.equal(row[0], regen[5 + j]), f"{name}: generate() step {j} != full forward"


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", ["llama-eager", "llama-sdpa", "moe-eager", "moe-sdpa"])
def test_sequence_alone_equals_itself_in_a_padded_batch_inside_the_mode(name, side):
    model, seqs = tiny_model(name), _seqs()
    with torch.no_grad(), batch_invariant_mode():
        alone = [model(input_ids=s[None]).logits[0] for s in seqs]
        batched = _batched(model, seqs, side)
    for i, (a, b) in enumerate(zip(alone, batched)):
        assert torch.equal(a, b), f"{name} {side}: sequence {i} differs in the batch"


@pytest.mark.parametrize("name", ["llama-eager", "moe-eager", "moe-sdpa"])
def test_batched_left_padded_generate_equals_generating_each_prompt_alone(name):
    model, seqs = tiny_model(name), _seqs()
    prompts = [seqs[0][:6], seqs[1][:3], seqs[2][:9]]
    t_max = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), t_max, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, t_max - len(p) :], mask[i, t_max - len(p) :] = p, 1
    kw = {"max_new_tokens": 5, "do_sample": False, "output_logits": True, "pad_token_id": 0}
    with torch.no_grad(), batch_invariant_mode():
        batch = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **kw)
        for i, p in enumerate(prompts):
            alone = model.generate(p[None], return_dict_in_generate=True, **kw)
            for j in range(5):
                assert torch.equal(alone.logits[j][0], batch.logits[j][i]), (
                    f"{name}: prompt {i} step {j} differs between batched and alone"
                )


@pytest.mark.parametrize("name", ["llama-eager", "moe-eager"])
def test_default_kernels_are_not_invariant_outside_the_mode(name):
    """The comparisons above fail on the default CPU kernels (BLAS, vectorised libm)."""
    model, seqs = tiny_model(name), _seqs()
    with torch.no_grad():
        alone = [model(input_ids=s[None]).logits[0] for s in seqs]
        step = _incremental(model, seqs[0])
        batched = _batched(model, seqs, "right")
    decode_exact = torch.equal(step, alone[0])
    batch_exact = all(torch.equal(a, b) for a, b in zip(alone, batched))
    assert not (decode_exact and batch_exact), "default kernels happened to be exact here"
    torch.testing.assert_close(step, alone[0], rtol=1e-5, atol=1e-5)  # close, just not equal


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_softmax_at_temperature_equals_kernels_logprobs(temperature):
    model, seq = tiny_model("moe-eager"), _seqs()[2]
    with torch.no_grad():
        logits = model(input_ids=seq[None]).logits
        want = log_probs(logits, temperature, inv.INVARIANT_OPS)
        with batch_invariant_mode():
            got = torch.log_softmax(logits / temperature, dim=-1)
            soft = torch.softmax(logits / temperature, dim=-1)
    assert torch.equal(got, want)
    torch.testing.assert_close(soft.log(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama-eager", "moe-eager", "moe-sdpa"])
def test_backward_inside_the_mode_matches_default_gradients_and_trains(name):
    seqs = _seqs()
    grads = {}
    for invariant in (False, True):
        model = tiny_model(name).train()
        model.zero_grad()
        with batch_invariant_mode() if invariant else torch.enable_grad():
            ids = seqs[2][None]
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        grads[invariant] = {
            n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
        }
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) > 10
    for n, g in grads[True].items():
        assert torch.isfinite(g).all(), n
        torch.testing.assert_close(g, grads[False][n], rtol=1e-4, atol=1e-6, msg=n)
    # an optimizer step inside the mode lowers the loss on the same batch
    model = tiny_model(name).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = seqs[2][None]
    with batch_invariant_mode():
        before = model(input_ids=ids, labels=ids).loss
        before.backward()
        opt.step()
        with torch.no_grad():
            after = model(input_ids=ids, labels=ids).loss
    assert after.item() < before.item()


class _OpRecorder(TorchDispatchMode):
    """Records every op the model dispatches (pushed above batch_invariant_mode, so it sees the
    model's ops, not the invariant kernels' own), split into forward and backward."""

    def __init__(self):
        super().__init__()
        self.forward, self.backward = set(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        (self.backward if in_backward() else self.forward).add(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", list(MODELS))
def test_every_op_the_model_dispatches_is_covered_or_exact(name):
    model, seqs = tiny_model(name).train(), _seqs()
    rec = _OpRecorder()
    with batch_invariant_mode(), rec:
        ids = seqs[2][None]
        model(input_ids=ids, labels=ids).loss.backward()
        with torch.no_grad():
            _incremental(model.eval(), seqs[1])
            _batched(model, seqs, "right")
            model.generate(  # sampling at a temperature with top-k / top-p filtering
                seqs[0][None],
                max_new_tokens=4,
                do_sample=True,
                temperature=0.7,
                top_k=50,
                top_p=0.9,
            )
    unknown = sorted(op.name() for op in rec.forward if classify(op) is None)
    assert not unknown, (
        f"{name} dispatches ops that batch_invariant_mode neither covers nor lists as exact: "
        f"{unknown}; cover them in kernels/hf_mode.py or argue them exact in EXACT_OPS_BY_REASON"
    )
    covered = {op.name() for op in rec.forward if classify(op) == "covered"}
    assert {"aten::mm", "aten::bmm", "aten::sin", "aten::cos", "aten::mean.dim"} <= covered
    assert rec.backward, "backward ops were dispatched inside the mode (default kernels)"


def test_uncovered_ops_and_arguments_run_default_and_are_reported():
    x = _rand(5, seed=31)
    with batch_invariant_mode():
        erfcx = torch.special.erfcx(x)
        exp64 = torch.exp(x.double())
        pow15 = x.abs() ** 1.5
    assert torch.equal(erfcx, torch.special.erfcx(x))
    assert torch.equal(exp64, torch.exp(x.double()))
    assert torch.equal(pow15, x.abs() ** 1.5)
    reported = hf_mode.uncovered_ops()
    assert "aten::special_erfcx" in reported
    assert "aten::exp (torch.float64 input)" in reported
    assert "aten::pow.Tensor_Scalar (exponent 1.5)" in reported


def test_mode_is_reentrant_and_thread_local():
    model, seq = tiny_model("llama-eager"), _seqs()[0]
    with torch.no_grad():
        default = model(input_ids=seq[None]).logits
        with batch_invariant_mode():
            invariant = model(input_ids=seq[None]).logits
    assert not torch.equal(default, invariant)
    results, errors = {}, []

    def run(key: str, enter: bool) -> None:
        try:
            torch.set_num_threads(1)
            with torch.no_grad():
                if enter:
                    with batch_invariant_mode(), batch_invariant_mode():  # re-entrant
                        assert hf_mode.is_active()
                        results[key] = model(input_ids=seq[None]).logits
                    assert not hf_mode.is_active()
                else:
                    results[key] = model(input_ids=seq[None]).logits
        except BaseException as e:  # surfaced below
            errors.append(e)

    with batch_invariant_mode():  # this thread is inside; the "outside" thread is not
        threads = [threading.Thread(target=run, args=(f"in{i}", True)) for i in range(2)]
        threads.append(threading.Thread(target=run, args=("out", False)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    assert torch.equal(results["in0"], invariant) and torch.equal(results["in1"], invariant)
    assert torch.equal(results["out"], default)
    assert not hf_mode.is_active()


# --- the covered kernels against their plain torch references ------------------------------------
def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_sin_cos_are_correctly_rounded_and_elementwise():
    x = torch.cat([torch.linspace(-1e5, 1e5, 400_001), _rand(1000, scale=10.0)])
    for fn, ref in ((inv.sin, torch.sin), (inv.cos, torch.cos)):
        got, want = fn(x), ref(x.double()).float()
        assert torch.equal(got, want), f"{fn.__name__} is not the correctly rounded value"
        assert torch.equal(fn(x[7:8]), got[7:8]) and torch.equal(fn(x[3:40]), got[3:40])
    special = inv.sin(torch.tensor([math.inf, math.nan, 0.0]))
    assert math.isnan(special[0]) and math.isnan(special[1]) and special[2] == 0
    with pytest.raises(AssertionError, match="arguments"):
        inv.cos(torch.tensor([2e6]))


def test_covered_ops_match_torch_and_are_row_invariant():
    x, w, b = _rand(9, 40, seed=1), _rand(40, 24, seed=2), _rand(24, seed=3)
    a3, b3 = _rand(3, 9, 40, seed=4), _rand(3, 40, 7, seed=5)
    with batch_invariant_mode():
        results = {
            "mm": (x @ w, lambda r: r[2:3] @ w),
            "addmm": (torch.addmm(b, x, w), lambda r: torch.addmm(b, r[2:3], w)),
            "bmm": (a3 @ b3, None),
            "softmax": (torch.softmax(x, -1), lambda r: torch.softmax(r[2:3], -1)),
            "sum": (x.sum(-1), lambda r: r[2:3].sum(-1)),
            "mean": (
                x.pow(2).mean(-1, keepdim=True),
                lambda r: r[2:3].pow(2).mean(-1, keepdim=True),
            ),
            "rsqrt": (torch.rsqrt(x.abs() + 1), None),
            "silu": (torch.nn.functional.silu(x), lambda r: torch.nn.functional.silu(r[2:3])),
            "sigmoid": (torch.sigmoid(x), None),
        }
        rows = {k: f(x)[0] if f else None for k, (_, f) in results.items() if f is not None}
    ref = {
        "mm": x @ w,
        "addmm": torch.addmm(b, x, w),
        "bmm": a3 @ b3,
        "softmax": torch.softmax(x, -1),
        "sum": x.sum(-1),
        "mean": x.pow(2).mean(-1, keepdim=True),
        "rsqrt": torch.rsqrt(x.abs() + 1),
        "silu": torch.nn.functional.silu(x),
        "sigmoid": torch.sigmoid(x),
    }
    for k, (got, _) in results.items():
        torch.testing.assert_close(got, ref[k], rtol=2e-6, atol=2e-6, msg=k)
    for k, row in rows.items():
        assert torch.equal(row, results[k][0][2]), f"{k}: row alone differs from row in batch"


def test_index_add_adds_duplicates_in_index_order_and_matches_torch():
    x, src = _rand(5, 4, seed=6), _rand(9, 4, seed=7, scale=1e3)
    index = torch.tensor([3, 1, 3, 0, 3, 1, 4, 4, 3])
    got = hf_mode._index_add(x, 0, index, src)
    torch.testing.assert_close(got, x.index_add(0, index, src))
    want_row3 = (((x[3] + src[0]) + src[2]) + src[4]) + src[8]
    assert torch.equal(got[3], want_row3)


def test_grouped_mm_matches_a_loop_of_matmuls():
    x, w = _rand(10, 16, seed=8), _rand(3, 16, 6, seed=9)
    offs = torch.tensor([4, 4, 9], dtype=torch.int32)  # group 1 empty, row 9 past the end
    got = hf_mode._grouped_mm(x, w, offs)
    want = torch.cat([x[:4] @ w[0], x[4:9] @ w[2], torch.zeros(1, 6)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["causal", "float-mask", "bool-mask-gqa"])
def test_flash_attention_for_cpu_matches_sdpa(case):
    q, k, v = _rand(2, 4, 5, 8, seed=10), _rand(2, 4, 7, 8, seed=11), _rand(2, 4, 7, 8, seed=12)
    kwargs: dict = {}
    if case == "causal":
        k, v = k[:, :, :5], v[:, :, :5]
        kwargs["is_causal"] = True
    elif case == "float-mask":
        kwargs["attn_mask"] = torch.where(_rand(2, 1, 5, 7, seed=13) > 0, 0.0, -1e9)
    else:
        k, v = k[:, :2], v[:, :2]
        kwargs["attn_mask"] = _rand(2, 1, 5, 7, seed=13) > -0.5
        kwargs["enable_gqa"] = True
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    with batch_invariant_mode():
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --- the exact-integer BLAS matmul (kernels/exact_matmul.py) --------------------------------------
@pytest.fixture
def integer_scheme():
    """The exact-integer `float64` scheme (the default is the fixed-order kernel, whose own tests
    are tests/unit/kernels/test_fixed_order.py)."""
    before = exact_matmul.SCHEME
    exact_matmul.SCHEME = "float64"
    yield
    exact_matmul.SCHEME = before


@pytest.mark.usefixtures("integer_scheme")
def test_exact_bmm_is_close_to_float64_and_independent_of_summation_order():
    a, b = _rand(2, 37, 256, seed=20), _rand(2, 256, 96, seed=21, scale=1 / 16)
    got = exact_bmm(a, b, hf_mode._tree_bmm)
    want = (a.double() @ b.double()).float()
    torch.testing.assert_close(got, want, rtol=0, atol=2.5e-7)  # within an ulp or so of fp64
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(22))
    assert torch.equal(exact_bmm(a[:, :, perm], b[:, perm], hf_mode._tree_bmm), got), (
        "summing K in another order changed bits: the float64 sums are not exact"
    )
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(exact_bmm(a, b, hf_mode._tree_bmm), got)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("scheme", ["fixed", "float64"])
def test_exact_bmm_is_row_and_zero_padding_invariant(scheme, monkeypatch):
    monkeypatch.setattr(exact_matmul, "SCHEME", scheme)
    a, b = _rand(1, 20, 48, seed=23), _rand(1, 48, 33, seed=24)
    full = exact_bmm(a, b, hf_mode._tree_bmm)
    assert torch.equal(exact_bmm(a[:, 7:8], b, hf_mode._tree_bmm), full[:, 7:8])
    garbage = _rand(1, 30, 33, seed=25, scale=1e4)  # pad keys' values: anything finite
    for a_pad, b_pad in (
        (torch.cat([a, torch.zeros(1, 20, 30)], 2), torch.cat([b, garbage], 1)),
        (torch.cat([torch.zeros(1, 20, 30), a], 2), torch.cat([garbage, b], 1)),
    ):
        assert torch.equal(exact_bmm(a_pad, b_pad, hf_mode._tree_bmm), full)


@pytest.mark.usefixtures("integer_scheme")
def test_exact_bmm_non_finite_rows_and_k_blocks():
    a, b = _rand(1, 6, 16, seed=26), _rand(1, 16, 5, seed=27)
    full = exact_bmm(a, b, hf_mode._tree_bmm)
    a_bad = a.clone()
    a_bad[0, 2, 3] = math.inf
    got = exact_bmm(a_bad, b, hf_mode._tree_bmm)
    assert not torch.isfinite(got[0, 2]).all()
    assert torch.equal(got[0, [0, 1, 3, 4, 5]], full[0, [0, 1, 3, 4, 5]])
    k = K_MAX + 7  # two K blocks
    a2, b2 = _rand(1, 2, k, seed=28), _rand(1, k, 3, seed=29)
    torch.testing.assert_close(
        exact_bmm(a2, b2, hf_mode._tree_bmm),
        (a2.double() @ b2.double()).float(),
        rtol=1e-6,
        atol=1e-5,
    )


@pytest.mark.parametrize("scheme", ["fixed", "float64"])
def test_exact_bmm_parameter_cache_follows_in_place_updates(scheme, monkeypatch):
    monkeypatch.setattr(exact_matmul, "SCHEME", scheme)
    lin = torch.nn.Linear(32, 8, bias=False)
    x = _rand(3, 32, seed=30)
    with torch.no_grad(), batch_invariant_mode():
        first = lin(x)
        again = lin(x)
        lin.weight.mul_(2.0)  # an optimizer step: bumps the version counter
        doubled = lin(x)
        lin.weight.data = lin.weight.data * 4.0  # a new storage, same version counter
        eightfold = lin(x)
    assert torch.equal(first, again)
    assert torch.equal(doubled, first * 2.0) and torch.equal(eightfold, first * 8.0)


def test_a_weight_derived_afresh_each_forward_is_packed_once_per_parameter_version(monkeypatch):
    """The policies substitute a bf16-rounded copy of every parameter per forward
    (`serving_weight`); `mark_derived` keys its packed form by the parameter and its version."""
    lin = torch.nn.Linear(32, 8, bias=False)
    packs = []
    pack = exact_matmul._pack

    def counting(b):
        packs.append(tuple(b.shape))
        return pack(b)

    counting.__name__ = "_pack"
    monkeypatch.setattr(exact_matmul, "_pack", counting)
    x = _rand(3, 32, seed=31)

    def forward():
        rounded = lin.weight.detach().to(torch.bfloat16).float()  # a new tensor each time
        w = exact_matmul.mark_derived(rounded, lin.weight, "bf16")
        return torch.nn.functional.linear(x, w)

    with torch.no_grad(), batch_invariant_mode():
        first, again = forward(), forward()
        assert len(packs) == 1, packs
        lin.weight.mul_(2.0)  # an optimizer step: the parameter's version moves
        doubled = forward()
    assert len(packs) == 2, packs
    assert torch.equal(first, again) and torch.equal(doubled, first * 2.0)


@pytest.mark.parametrize("scheme", ["fixed", "float64"])
def test_attention_scores_do_not_depend_on_later_keys_inside_the_mode(scheme, monkeypatch):
    """q @ k^T for the first keys has the same bits whatever keys follow (a KV-cache decode step
    sees only the keys so far, a full forward all of them): under the fixed-order kernel because
    each score is its own chain over the head dimension, under the integer schemes because aten.bmm
    takes the tree. The exact-integer kernel alone would not: it scales each K-row of b (a head
    dimension, spanning every key) by its largest value, so a large later key changes the earlier
    scores."""
    monkeypatch.setattr(exact_matmul, "SCHEME", scheme)
    q, k = _rand(2, 1, 16, seed=40), _rand(2, 16, 5, seed=41)  # k^T: [B, head dim, keys]
    later = _rand(2, 16, 3, seed=42, scale=1e6)
    with_later = torch.cat([k, later], 2)
    with torch.no_grad(), batch_invariant_mode():
        assert torch.equal(torch.bmm(q, with_later)[:, :, :5], torch.bmm(q, k))
    monkeypatch.setattr(exact_matmul, "SCHEME", "float64")
    assert not torch.equal(
        exact_bmm(q, with_later, hf_mode._tree_bmm)[:, :, :5], exact_bmm(q, k, hf_mode._tree_bmm)
    ), "the exact-integer kernel's K-row scales do span N: it is not invariant to later keys"
