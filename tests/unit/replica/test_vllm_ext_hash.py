"""The vLLM worker extension's hashing and inverse map, as pure logic (no vLLM process, no vLLM
import: these run in the project's environment).

app/replica/engines/vllm_worker/flywheel_vllm_ext.py runs inside vLLM's environment and must not
import Flywheel, so it re-implements the tensor and checkpoint SHA-256 of kernels/delta/hashing.py:
here both are compared on every dtype the serving weights use, odd shapes, non-contiguous views,
special values and a whole HF serving state dict.

Its probe (`_flywheel_probe`) learns where vLLM's loaders put each checkpoint element, and
`_flywheel_hash` reads the checkpoint tensors back through that map. Both only rely on
`_flywheel_reload(items) -> {param name: tensor}`; `FusingLoader` below stands in for vLLM's model
loaders with the layouts they really use (q/k/v fused into `qkv_proj`, gate/up fused per expert
into a 3-D `w13_weight` and down stacked into `w2_weight`, the shared expert's gate/up fused into
`gate_up_proj`, the vocabulary padded to a multiple of 64, bf16 parameters that round what is
copied in, parameters that keep their values between reloads). It is an emulation of the
loaders' layout for a unit test of the map's logic; tests/integration/replica/test_vllm_engine.py
runs the same extension inside real vLLM servers."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kernels.delta import hashing

EXT_PATH = (
    Path(__file__).resolve().parents[3]
    / "app"
    / "replica"
    / "engines"
    / "vllm_worker"
    / "flywheel_vllm_ext.py"
)


def _load_ext():
    """The extension module, imported the way vLLM imports it (a top-level module from its folder)."""
    spec = importlib.util.spec_from_file_location("flywheel_vllm_ext", EXT_PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ext = _load_ext()


def test_the_extension_imports_nothing_from_flywheel():
    """It runs in vLLM's environment, where Flywheel's packages are not installed."""
    tree = ast.parse(EXT_PATH.read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add((node.module or "").split(".")[0])
    assert not roots & {"app", "kernels", "trainer", "policy", "streams", "tests"}, roots


# --- the digests ---------------------------------------------------------------------------------
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (4, 5), (2, 3, 5), (1, 1, 1, 1)]


def _rand(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tensor_digest_equals_flywheels(dtype, shape):
    t = _rand(shape, dtype)
    assert ext.tensor_sha256(t) == hashing.tensor_sha256(t)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_digest_of_non_contiguous_views_equals_flywheels(dtype):
    base = _rand((6, 8, 4), dtype, seed=1)
    views = {
        "transpose": base.transpose(0, 2),
        "step": base[::2, 1::3],
        "permute": base.permute(1, 2, 0),
        "column": base[:, 3, :],
        "expand": base[0, 0, :1].expand(5, 3),
        "offset": base.reshape(-1)[7:20],
        "scalar view": base[1, 2, 3],
    }
    for name, v in views.items():
        assert ext.tensor_sha256(v) == hashing.tensor_sha256(v), name
        # a view hashes as its values, never as its storage
        assert ext.tensor_sha256(v) == hashing.tensor_sha256(v.contiguous().clone()), name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_digest_covers_special_values_dtype_and_shape(dtype):
    t = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, 3.0]).to(dtype)
    assert ext.tensor_sha256(t) == hashing.tensor_sha256(t)
    assert ext.tensor_sha256(t.reshape(7, 1)) == hashing.tensor_sha256(t.reshape(7, 1))
    assert ext.tensor_sha256(t.reshape(7, 1)) != ext.tensor_sha256(t)  # the shape is hashed
    flipped = t.clone()
    flipped.view({2: torch.int16, 4: torch.int32}[t.element_size()])[1] ^= 1  # -0.0, one bit
    assert ext.tensor_sha256(flipped) != ext.tensor_sha256(t)
    assert ext.tensor_sha256(flipped) == hashing.tensor_sha256(flipped)


def test_bf16_and_float16_of_the_same_bits_hash_differently():
    bits = torch.arange(12, dtype=torch.int16)
    a, b = bits.view(torch.bfloat16), bits.view(torch.float16)
    assert ext.tensor_sha256(a) != ext.tensor_sha256(b)
    assert ext.tensor_sha256(b) == hashing.tensor_sha256(b)


def test_checkpoint_digest_equals_flywheels_for_names_in_byte_order():
    names = ["b", "a", "é", "z.weight", "A", "a.b", "a_b", "ü.x", ""]
    state = {n: _rand((i + 1, 2), torch.bfloat16, seed=i) for i, n in enumerate(names)}
    digests, sha = hashing.hash_state_dict(state)
    assert ext.checkpoint_sha256_from_digests(digests) == sha
    assert ext.checkpoint_sha256_from_digests(dict(reversed(list(digests.items())))) == sha
    del digests["a"]
    assert ext.checkpoint_sha256_from_digests(digests) != sha


# --- a tiny HF model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_state(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The bf16 serving state dict (checkpoint names) of tests/hf_models.py's tiny Qwen2-MoE."""
    from policy import build_policy
    from tests.hf_models import tiny_qwen2_moe_dir, train_bpe_tokenizer

    root = tmp_path_factory.mktemp("vllm-ext")
    model = tiny_qwen2_moe_dir(root / "moe", train_bpe_tokenizer(root / "tok"))
    return build_policy({"type": "hf", "model_dir": str(model)}).serving_state_dict()


def test_whole_hf_serving_state_hashes_as_flywheel_hashes_it(hf_state):
    digests = {n: ext.tensor_sha256(t) for n, t in hf_state.items()}
    want_digests, want = hashing.hash_state_dict(hf_state)
    assert digests == want_digests
    assert ext.checkpoint_sha256_from_digests(digests) == want


# --- the inverse map: a loader with vLLM's layouts ------------------------------------------------
_QKV = re.compile(r"^(.*\.self_attn)\.([qkv])_proj\.(weight|bias)$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_SHARED = re.compile(r"^(.*\.mlp\.shared_expert)\.(gate|up)_proj\.weight$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
PAD = 64  # vLLM pads the vocabulary dimension


class FusingLoader(ext.FlywheelWorkerExtension):
    """The extension over an emulated vLLM model: `_flywheel_reload` copies checkpoint tensors into
    fused, stacked and padded bf16 parameters, in place (parameters keep their values between
    reloads, as vLLM's do).

    `drop`: checkpoint names the loader ignores (their parameter exists but is never written).
    `misplace`: (name, flat index): after `fault_on()`, that element of that tensor is also written
    one place further on (the element after it is wrong); the probe never sees the fault."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], drop=(), misplace=None) -> None:
        self.drop, self.misplace, self.faulty, self.reloads = set(drop), misplace, False, 0
        self.params: dict[str, torch.Tensor] = {}
        self.route: dict[str, tuple[str, tuple]] = {}  # checkpoint name -> (param, index)
        g = torch.Generator().manual_seed(123)
        want: dict[str, list[int]] = {}
        for name, shape in sorted(shapes.items()):
            pname, at, pshape = self._place(name, tuple(shape), shapes)
            self.route[name] = (pname, at)
            want[pname] = pshape
        for pname, pshape in want.items():  # "dummy" random weights until a load writes them
            self.params[pname] = (torch.rand(pshape, generator=g) * 0.1).to(torch.bfloat16)

    @staticmethod
    def _place(name, shape, shapes):
        """(parameter, index into it, parameter shape) of checkpoint tensor `name`."""
        if m := _QKV.match(name):
            prefix, which, kind = m.groups()
            rows = [shapes[f"{prefix}.{x}_proj.{kind}"][0] for x in "qkv"]
            start = sum(rows[: "qkv".index(which)])
            return (
                f"{prefix}.qkv_proj.{kind}",
                (slice(start, start + shape[0]),),
                [sum(rows), *shape[1:]],
            )
        if m := _EXPERT.match(name):
            prefix, e, which = m.group(1), int(m.group(2)), m.group(3)
            n_exp = 1 + max(
                int(x.group(2)) for k in shapes if (x := _EXPERT.match(k)) and x.group(1) == prefix
            )
            if which == "down":
                return f"{prefix}.w2_weight", (e,), [n_exp, *shape]
            inter = shape[0]
            rows = slice(0, inter) if which == "gate" else slice(inter, 2 * inter)
            return f"{prefix}.w13_weight", (e, rows), [n_exp, 2 * inter, shape[1]]
        if m := _SHARED.match(name):
            inter = shape[0]
            rows = slice(0, inter) if m.group(2) == "gate" else slice(inter, 2 * inter)
            return f"{m.group(1)}.gate_up_proj.weight", (rows,), [2 * inter, shape[1]]
        if name in _VOCAB:
            padded = -(-shape[0] // PAD) * PAD
            return name, (slice(0, shape[0]),), [padded, *shape[1:]]
        return name, (Ellipsis,), list(shape)

    def fault_on(self) -> None:
        self.faulty = True

    def _flywheel_reload(self, items):
        self.reloads += 1
        for name, value in items:
            if name in self.drop:
                continue
            pname, at = self.route[name]
            value = value.clone()
            if self.faulty and self.misplace and self.misplace[0] == name:
                flat = value.reshape(-1)
                flat[self.misplace[1] + 1] = flat[self.misplace[1]]
            self.params[pname][at] = value  # copy_: rounds to the bf16 parameter
        return {k: v.clone() for k, v in self.params.items()}


def _shapes(state):
    return {k: list(v.shape) for k, v in state.items()}


def test_the_emulated_loader_fuses_stacks_and_pads(hf_state):
    """The layouts the map has to invert are really there (else the tests below prove little)."""
    loader = FusingLoader(_shapes(hf_state))
    params = loader._flywheel_reload(sorted(hf_state.items()))
    assert "model.layers.0.self_attn.qkv_proj.weight" in params
    assert "model.layers.0.self_attn.q_proj.weight" not in params
    w13 = params["model.layers.0.mlp.experts.w13_weight"]
    up1 = hf_state["model.layers.0.mlp.experts.1.up_proj.weight"]
    assert w13.ndim == 3 and torch.equal(w13[1, up1.shape[0] :], up1)
    assert params["lm_head.weight"].shape[0] % PAD == 0
    assert params["lm_head.weight"].shape[0] > hf_state["lm_head.weight"].shape[0]
    assert "model.layers.0.mlp.shared_expert.gate_up_proj.weight" in params


def test_hash_of_what_the_loader_holds_equals_the_checkpoint_hash(hf_state):
    loader = FusingLoader(_shapes(hf_state))
    loader._flywheel_probe(_shapes(hf_state))
    out = loader._flywheel_hash(loader._flywheel_reload(sorted(hf_state.items())))
    want_digests, want = hashing.hash_state_dict(hf_state)
    assert out["missing"] == []
    assert out["digests"] == want_digests
    assert out["sha256"] == want


def test_another_state_after_the_probe_hashes_to_its_own_checkpoint_hash(hf_state):
    """The map is measured once per architecture; every later version reads through it."""
    loader = FusingLoader(_shapes(hf_state))
    loader._flywheel_probe(_shapes(hf_state))
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        other = {
            k: torch.randn(v.shape, generator=g).to(torch.bfloat16) for k, v in hf_state.items()
        }
        out = loader._flywheel_hash(loader._flywheel_reload(sorted(other.items())))
        assert out["sha256"] == hashing.checkpoint_sha256(other)
        assert out["sha256"] != hashing.checkpoint_sha256(hf_state)


def test_float32_values_are_hashed_as_the_bf16_vllm_holds(hf_state):
    """vLLM's bf16 parameters round what is loaded: the hash is of the bf16 values."""
    loader = FusingLoader(_shapes(hf_state))
    loader._flywheel_probe(_shapes(hf_state))
    g = torch.Generator().manual_seed(5)
    fp32 = {k: torch.randn(v.shape, generator=g) for k, v in hf_state.items()}
    out = loader._flywheel_hash(loader._flywheel_reload(sorted(fp32.items())))
    assert out["sha256"] == hashing.checkpoint_sha256({k: v.bfloat16() for k, v in fp32.items()})


def test_a_tensor_the_loader_drops_is_missing_and_there_is_no_checkpoint_hash(hf_state):
    dropped = "model.layers.1.post_attention_layernorm.weight"
    loader = FusingLoader(_shapes(hf_state), drop={dropped})
    loader._flywheel_probe(_shapes(hf_state))
    out = loader._flywheel_hash(loader._flywheel_reload(sorted(hf_state.items())))
    assert out["missing"] == [dropped]
    assert out["sha256"] is None
    assert dropped not in out["digests"]
    assert len(out["digests"]) == len(hf_state) - 1


def test_one_misplaced_element_changes_exactly_that_tensors_digest(hf_state):
    name = "model.layers.0.self_attn.k_proj.weight"
    flat = hf_state[name].reshape(-1)
    i = next(j for j in range(flat.numel() - 1) if flat[j] != flat[j + 1])
    loader = FusingLoader(_shapes(hf_state), misplace=(name, i))
    loader._flywheel_probe(_shapes(hf_state))
    loader.fault_on()
    out = loader._flywheel_hash(loader._flywheel_reload(sorted(hf_state.items())))
    want = hashing.hash_state_dict(hf_state)[0]
    assert [n for n in want if out["digests"][n] != want[n]] == [name]
    assert out["sha256"] != hashing.checkpoint_sha256(hf_state)


class DuplicatingLoader(FusingLoader):
    """Also writes one checkpoint tensor into a second parameter."""

    def _flywheel_reload(self, items):
        params = super()._flywheel_reload(items)
        params["copy_of_norm"] = dict(items)["model.norm.weight"].to(torch.bfloat16).clone()
        return params


class PartialLoader(FusingLoader):
    """Writes only the first half of one checkpoint tensor."""

    def _flywheel_reload(self, items):
        params = super()._flywheel_reload([(n, v) for n, v in items if n != "model.norm.weight"])
        value = dict(items)["model.norm.weight"]
        half = value.shape[0] // 2
        self.params["model.norm.weight"][:half] = value[:half]
        params["model.norm.weight"] = self.params["model.norm.weight"].clone()
        return params


@pytest.mark.parametrize(
    ("loader_cls", "found"),
    [(DuplicatingLoader, "64 of 64"), (PartialLoader, "32 of 64")],
    ids=["twice", "partly"],
)
def test_a_loader_that_places_a_tensor_twice_or_partly_is_refused_by_the_probe(
    hf_state, loader_cls, found
):
    """The map must be a bijection: a tensor in two parameters, or half of one, is an error
    that names it (never a hash of whatever part was found)."""
    loader = loader_cls(_shapes(hf_state))
    with pytest.raises(RuntimeError, match=rf"model\.norm\.weight in more .* \({found} elements"):
        loader._flywheel_probe(_shapes(hf_state))


def test_the_update_rpc_probes_once_and_reports_json(hf_state, tmp_path):
    """`flywheel_update(path)`: the safetensors file in, the JSON report out; the probe runs on the
    first update of an architecture only (2 + digit loads), then one load per update."""
    path = tmp_path / "engine0.safetensors"
    save_file(hf_state, str(path))
    loader = FusingLoader(_shapes(hf_state))
    first = json.loads(loader.flywheel_update(str(path)))
    probe_loads = loader.reloads - 1
    assert probe_loads >= 3
    assert first["sha256"] == hashing.checkpoint_sha256(hf_state)
    assert first["missing"] == []
    assert set(first["seconds"]) == {"probe", "load", "hash"}
    g = torch.Generator().manual_seed(9)
    other = {k: torch.randn(v.shape, generator=g).to(torch.bfloat16) for k, v in hf_state.items()}
    save_file(other, str(path))
    before = loader.reloads
    second = json.loads(loader.flywheel_update(str(path)))
    assert loader.reloads == before + 1
    assert second["sha256"] == hashing.checkpoint_sha256(other)
