"""Flywheel's vLLM worker extension: load a verified checkpoint in place and hash what vLLM holds.

vLLM imports this module in its own environment (`--worker-extension-cls
flywheel_vllm_ext.FlywheelWorkerExtension`, with this folder on PYTHONPATH) and mixes the class into
its worker; the replica calls the methods through vLLM's `/collective_rpc` (app/replica/engines/
vllm.py). It imports nothing from Flywheel: torch, numpy and safetensors come from vLLM's environment.

- `flywheel_update(path)`: reload the model's weights in place from a checkpoint-format safetensors
  file (vLLM's layerwise reload, `model_runner.reload_weights`), and return the per-tensor SHA-256s
  of the weights vLLM's loaders placed in its parameters, under the checkpoint's names.

Hashing what vLLM holds needs the inverse of vLLM's loading (checkpoint tensors are renamed, fused
into `qkv_proj` / `gate_up_proj` / `w13_weight`, padded). The extension measures it once per engine
with probes: it loads checkpoints whose elements spell their own index (in base-256 digits, exact in
bf16) and reads where each element landed. The values are read right after the loaders copied them
in and before vLLM's kernel-specific processing (on CPU, oneDNN / AMX repacking that frees the
plain weights), by wrapping each layer's `process_weights_after_loading` for the reload; layers
without processing are read after it. See docs/REPLICA.md "Engines".
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import torch


def _patch_vllm_cpu() -> None:
    """On CPU, two things in vLLM 0.32 keep an in-place reload from taking effect, so this module
    changes them when vLLM imports it (before the model is loaded):

    - linear layers (and the LM head) run from copies packed for oneDNN / AMX at load time
      (`dispatch_cpu_unquantized_gemm`), and most drop their plain weight; here they run
      `torch.nn.functional.linear` on the live parameter, so a reload changes what they compute
      and the weights stay readable;
    - the unquantized fused-MoE method re-packs the experts for the CPU kernel on the first load
      only: on a reload it copies the new, unpacked weights into the packed storage (measured
      here: completions no longer matched the loaded weights). Here the CPU experts' own
      `process_weights_after_loading` (the packing) runs again after every reload.

    On GPU neither applies and nothing is changed."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # imported outside vLLM (tests of the hashing)
        return
    if not current_platform.is_cpu():
        return
    import vllm.model_executor.layers.utils as layer_utils
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as moe

    def plain_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    layer_utils.dispatch_cpu_unquantized_gemm = plain_linear
    setup = moe.UnquantizedFusedMoEMethod._setup_kernel

    def setup_kernel(self: Any, layer: torch.nn.Module, w13: Any, w2: Any) -> None:
        update = self.moe_kernel is not None
        setup(self, layer, w13, w2)
        if update:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    moe.UnquantizedFusedMoEMethod._setup_kernel = setup_kernel


_patch_vllm_cpu()


def tensor_sha256(t: torch.Tensor) -> str:
    """Flywheel's tensor digest (kernels/delta/hashing.py, format v1) of a bf16/float tensor."""
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    ints = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    flat = t.detach().cpu().contiguous().reshape(-1).view(ints[t.dtype])
    h = hashlib.sha256(b"flywheel-tensor-v1\0")
    h.update(names[t.dtype].encode() + b"\0" + ",".join(str(int(s)) for s in t.shape).encode())
    h.update(b"\0")
    h.update(flat.numpy().view("u1").data)
    return h.hexdigest()


def checkpoint_sha256_from_digests(digests: dict[str, str]) -> str:
    h = hashlib.sha256(b"flywheel-checkpoint-v1\0")
    for name in sorted(digests, key=lambda n: n.encode()):
        raw = name.encode()
        h.update(struct.pack("<I", len(raw)) + raw + bytes.fromhex(digests[name]))
    return h.hexdigest()


class FlywheelWorkerExtension:
    """Mixed into vLLM's worker (`--worker-extension-cls`); state lives on the worker object."""

    # --- loading with capture -----------------------------------------------------------------
    def _flywheel_reload(self, items: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Reload `items` (checkpoint names) in place; return every parameter's values as the
        loaders left them (before kernel processing), by full parameter name."""
        model = self.model_runner.get_model()
        captured: dict[str, torch.Tensor] = {}
        wrapped: list[Any] = []
        names = {id(mod): name for name, mod in model.named_modules()}

        def capture(layer: torch.nn.Module) -> None:
            prefix = names.get(id(layer), "")
            for pname, p in layer.named_parameters(recurse=False):
                captured[f"{prefix}.{pname}" if prefix else pname] = p.detach().clone()

        for mod in model.modules():
            qm = getattr(mod, "quant_method", None)
            if qm is None or not hasattr(qm, "process_weights_after_loading"):
                continue
            if "process_weights_after_loading" in vars(qm):
                continue  # one quant method shared by layers: wrapped once
            orig = qm.process_weights_after_loading

            def process(layer: torch.nn.Module, *a: Any, _orig: Any = orig, **kw: Any) -> Any:
                capture(layer)
                return _orig(layer, *a, **kw)

            qm.process_weights_after_loading = process
            wrapped.append(qm)
        try:
            self.model_runner.reload_weights(
                weights_iterator=iter(items), is_checkpoint_format=True
            )
        finally:
            for qm in wrapped:
                del qm.process_weights_after_loading
        for name, p in model.named_parameters():  # layers vLLM does not process: as they are now
            if name not in captured:
                captured[name] = p.detach().clone()
        return captured

    # --- the inverse map ----------------------------------------------------------------------
    def _flywheel_probe(self, shapes: dict[str, list[int]]) -> None:
        """Measure where every element of every checkpoint tensor lands in vLLM's parameters."""
        order = sorted(shapes)
        offsets, total = {}, 0
        for name in order:
            offsets[name] = total
            total += int(torch.Size(shapes[name]).numel())
        digits = max(1, (max(total - 1, 1).bit_length() + 7) // 8)

        def load(values_of: Any) -> dict[str, torch.Tensor]:
            items = [(n, values_of(n).to(torch.bfloat16).reshape(shapes[n])) for n in order]
            # on the host: the index arithmetic below is on CPU tensors (vLLM's are on the GPU)
            return {k: v.cpu().float() for k, v in self._flywheel_reload(items).items()}

        def index(n: str) -> torch.Tensor:
            k = int(torch.Size(shapes[n]).numel())
            return torch.arange(offsets[n], offsets[n] + k, dtype=torch.int64)

        ones = load(lambda n: torch.ones(shapes[n]))
        twos = load(lambda n: torch.full(shapes[n], 2.0))
        held = {k: (ones[k] == 1) & (twos[k] == 2) for k in ones}
        code = {k: torch.zeros(v.shape, dtype=torch.int64) for k, v in held.items()}
        for d in range(digits):
            got = load(lambda n, d=d: ((index(n) >> (8 * d)) & 255).float())
            for k in code:
                code[k] += got[k].round().to(torch.int64) << (8 * d)
        where: dict[str, tuple[str, torch.Tensor]] = {}
        starts = torch.tensor([offsets[n] for n in order], dtype=torch.int64)
        for pname, mask in held.items():
            flat_mask = mask.reshape(-1)
            if not bool(flat_mask.any()):
                continue
            pos = flat_mask.nonzero().reshape(-1)
            src = code[pname].reshape(-1)[pos]
            owner = torch.searchsorted(starts, src, right=True) - 1
            for i in owner.unique().tolist():
                n = order[i]
                sel = owner == i
                rel, at = src[sel] - offsets[n], pos[sel]
                perm = torch.argsort(rel)
                rel, at = rel[perm], at[perm]
                numel = int(torch.Size(shapes[n]).numel())
                if n in where or rel.numel() != numel or not torch.equal(rel, torch.arange(numel)):
                    raise RuntimeError(
                        f"vLLM's loaders place checkpoint tensor {n} in more than one parameter "
                        f"or only partly ({rel.numel()} of {numel} elements found in {pname})"
                    )
                where[n] = (pname, at)
        self._flywheel_where = where
        self._flywheel_shapes = dict(shapes)

    def _flywheel_hash(self, params: dict[str, torch.Tensor]) -> dict[str, Any]:
        digests, missing = {}, []
        for n, shape in self._flywheel_shapes.items():
            if n not in self._flywheel_where:
                missing.append(n)
                continue
            pname, at = self._flywheel_where[n]
            values = params[pname].reshape(-1)[at].to(torch.bfloat16).reshape(shape)
            digests[n] = tensor_sha256(values)
        return {
            "digests": digests,
            "sha256": checkpoint_sha256_from_digests(digests) if not missing else None,
            "missing": sorted(missing),
        }

    # --- RPCs ---------------------------------------------------------------------------------
    def flywheel_update(self, path: str) -> str:
        """Load the safetensors checkpoint at `path` in place; JSON of what the engine now holds:
        {digests: {name: sha256}, sha256: checkpoint hash, missing: [names vLLM does not hold],
        seconds: {probe, load, hash}}."""
        import time

        from safetensors.torch import load_file

        state = load_file(path)
        t0 = time.perf_counter()
        shapes = {k: list(v.shape) for k, v in state.items()}
        if getattr(self, "_flywheel_shapes", None) != shapes:
            self._flywheel_probe(shapes)  # once per architecture: the engine's model is fixed
        t1 = time.perf_counter()
        params = self._flywheel_reload(sorted(state.items()))
        t2 = time.perf_counter()
        out = self._flywheel_hash(params)
        del params
        out["seconds"] = {"probe": t1 - t0, "load": t2 - t1, "hash": time.perf_counter() - t2}
        return json.dumps(out)
