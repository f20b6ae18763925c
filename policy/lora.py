"""LoRA on a Hugging Face policy (peft): a frozen base plus a trained low-rank adapter.

    policy = to_lora(full_hf_policy, LoraSpec(r=8, target_parameters=["mlp.experts.gate_up_proj"]))
    policy.serving_state_dict()      # the adapter only: bf16, peft's adapter_model names
    build_policy(policy.config_dict())   # any role: the same base + an adapter to load

What a LoRA version is: the base model's files + the adapter. The base weights are part of the
model's files (`model.safetensors` in the set policy/hf_files.py packs, so the config's
`files_sha256` covers them and every role materializes the same verified base), and the serving
state dict is the adapter alone, so the registry's per-tensor and checkpoint SHA-256s cover the
adapter and delta sync between LoRA versions moves adapter bytes only. `to_lora` makes the base
from a full policy's bf16 serving weights, so the base of a LoRA line is exactly the version it
started from.

Numerics: the base is frozen and holds bf16-exact values (rounded once at build), which is what
`serving_weight` would give; a forward substitutes only the adapter's bf16-rounded masters
(`_forward_params`), so a trainer with fp32 adapter masters and a replica with the bf16 adapter
compute the same forward. peft's LoRA layers run inside the same `batch_invariant_mode` as the
base (their `mm` / `addmm` / `baddbmm` are covered ops, docs/NUMERICS.md).

Targets are checked against the model before peft sees them: a `target_modules` entry must name
(or be the dotted suffix of) at least one `nn.Linear`, a `target_parameters` entry at least one
parameter; the error names every one that does not.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import torch

from policy.hf import HFConfig, HFPolicy
from policy.lora_spec import LoraSpec
from policy.moe_lm import serving_weight

log = logging.getLogger(__name__)


class LoraTargetError(ValueError):
    """LoRA targets that the model does not have."""


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def check_targets(model: torch.nn.Module, spec: LoraSpec) -> None:
    """Raise LoraTargetError naming every target the model does not have (module docstring)."""
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    params = [n for n, _ in model.named_parameters()]
    bad_modules = [t for t in spec.target_modules if not any(_matches(n, t) for n in linears)]
    bad_params = [t for t in spec.target_parameters if not any(_matches(n, t) for n in params)]
    if bad_modules or bad_params:
        kinds = sorted({n.rsplit(".", 1)[-1] for n in linears})
        fused = sorted(
            {".".join(n.split(".")[-3:]) for n, p in model.named_parameters() if p.ndim == 3}
        )
        raise LoraTargetError(
            f"LoRA targets not in the model ({type(model).__name__}): "
            + "; ".join(
                s
                for s in (
                    f"target_modules {bad_modules} (its Linear modules: {kinds})"
                    if bad_modules
                    else "",
                    f"target_parameters {bad_params} (its fused 3-d parameters: {fused or 'none'})"
                    if bad_params
                    else "",
                )
                if s
            )
        )


def peft_config(spec: LoraSpec) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        target_parameters=list(spec.target_parameters) or None,
        bias="none",
    )


class LoraPolicy(HFPolicy):
    """An HFPolicy whose model is a peft `PeftModel`: frozen bf16-exact base, fp32 adapter masters."""

    def __init__(self, config: HFConfig) -> None:
        assert config.lora is not None, "LoraPolicy needs a config with `lora`"
        super().__init__(config)
        from peft import get_peft_model
        from peft.utils import get_peft_model_state_dict

        check_targets(self.model, config.lora)
        with torch.no_grad():
            for p in self.model.parameters():
                p.requires_grad_(False)
                p.copy_(p.to(torch.bfloat16).to(p.dtype))  # the base computes with bf16 values
        self.model = get_peft_model(self.model, peft_config(config.lora))
        self.model.eval()
        own = self.model.state_dict(keep_vars=True)
        by_id = {id(t): k for k, t in own.items()}
        adapter = get_peft_model_state_dict(self.model, state_dict=own)
        # saved (adapter_model.safetensors) name -> the model's state-dict key
        self._adapter_keys = {saved: by_id[id(t)] for saved, t in adapter.items()}
        assert self._adapter_keys, "peft created no adapter tensors"
        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        assert trainable == set(self._adapter_keys.values()), (
            f"trainable parameters {sorted(trainable - set(self._adapter_keys.values()))[:3]} are "
            f"not adapter tensors"
        )
        # peft's ParamWrapper registers a parametrization on the expert module for the length of
        # each forward: `shadow()` (another thread: a replica's sync) must not copy the module then
        self._forward_lock = threading.RLock()

    @property
    def lora(self) -> LoraSpec:
        assert self.config.lora is not None
        return self.config.lora

    def forward_logits(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        with self._forward_lock:
            return super().forward_logits(*args, **kwargs)

    def _forward_params(self) -> dict[str, torch.Tensor]:
        """Only the adapter is substituted (bf16-rounded); the frozen base already holds bf16 values."""
        params = dict(self.model.named_parameters())
        return {k: serving_weight(params[k]) for k in self._adapter_keys.values()}

    def adapter_parameters(self) -> list[torch.nn.Parameter]:
        params = dict(self.model.named_parameters())
        return [params[k] for k in self._adapter_keys.values()]

    # --- the trainer's local state: the adapter's fp32 masters --------------------------------------
    def train_state_dict(self) -> dict[str, torch.Tensor]:
        """The adapter's fp32 masters under the peft model's state-dict keys (`...lora_A...`,
        `...lora_B...`), no base tensor: `build_policy(config_dict())` rebuilds the base from the
        model files its `files_sha256` names and verifies (policy/hf_files.py `resolve`)."""
        own = self.model.state_dict()
        return {key: own[key].detach().clone() for key in self._adapter_keys.values()}

    def load_train_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        want = set(self._adapter_keys.values())
        missing, extra = sorted(want - set(state)), sorted(set(state) - want)
        if missing or extra:
            raise ValueError(
                f"trainer state is not this LoRA adapter's masters: missing {missing[:3]}, "
                f"unexpected {extra[:3]} ({len(missing)} missing, {len(extra)} unexpected)"
            )
        own = self.model.state_dict()
        with torch.no_grad():
            for key in want:
                if state[key].shape != own[key].shape:
                    raise ValueError(
                        f"trainer state {key}: shape {tuple(state[key].shape)}, "
                        f"the adapter's is {tuple(own[key].shape)}"
                    )
                own[key].copy_(state[key])

    # --- serving weights: the adapter ---------------------------------------------------------
    def serving_state_dict(self) -> dict[str, torch.Tensor]:
        own = self.model.state_dict()
        return {
            saved: own[key].detach().to(torch.bfloat16).contiguous()
            for saved, key in self._adapter_keys.items()
        }

    def load_serving_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = sorted(set(self._adapter_keys) - set(state))
        extra = sorted(set(state) - set(self._adapter_keys))
        if missing or extra:
            raise ValueError(
                f"serving state dict is not this LoRA adapter: missing {missing[:5]}, unexpected "
                f"{extra[:5]} ({len(missing)} missing, {len(extra)} unexpected)"
            )
        own = self.model.state_dict()
        with torch.no_grad():
            for saved, key in self._adapter_keys.items():
                value = state[saved]
                if value.shape != own[key].shape:
                    raise ValueError(
                        f"{saved}: shape {tuple(value.shape)}, expected {tuple(own[key].shape)}"
                    )
                own[key].copy_(value.to(own[key].dtype))

    def shadow(self) -> LoraPolicy:
        """A copy sharing the frozen base tensors (never written) with fresh, UNINITIALISED
        adapter tensors, for `load_serving_state_dict` to fill (app/replica/weights.py). Waits for
        a forward running on another thread to end (the modules are copied between forwards)."""
        with self._forward_lock:
            own = self.model.state_dict(keep_vars=True)
            adapter = {id(own[k]) for k in self._adapter_keys.values()}
            memo: dict[int, Any] = {id(self._forward_lock): threading.RLock()}
            for t in self.state_dict(keep_vars=True).values():
                if id(t) in memo:
                    continue
                if id(t) in adapter:
                    fresh = torch.empty_like(t)
                    memo[id(t)] = torch.nn.Parameter(fresh, requires_grad=t.requires_grad)
                else:
                    memo[id(t)] = t  # shared: the base is frozen and identical in both
            return copy.deepcopy(self, memo)

    # --- export -----------------------------------------------------------------------------------
    def base_dir(self) -> Path:
        from policy.hf_files import resolve

        return resolve(self.config.model_dir, self.config.files_sha256, weights=True)

    def save_adapter(self, out: str | Path) -> Path:
        """`adapter_config.json` + `adapter_model.safetensors` that `PeftModel.from_pretrained` loads."""
        out = Path(out)
        self.model.save_pretrained(str(out))
        return out

    def merged_model(self) -> Any:
        """A plain `transformers` model (fp32) with the adapter merged into the base weights."""
        with self._forward_lock:  # peft parametrizes fused experts during a forward
            return copy.deepcopy(self.model).merge_and_unload()

    def effective_state_dict(self) -> dict[str, torch.Tensor]:
        """The merged weights (base + scale * B @ A, rounded once to bf16) under the names a full
        version of the base model serves: with a zero adapter, exactly the base's serving state."""
        return self._bf16_saved_state(self.merged_model())


def to_lora(policy: HFPolicy, spec: LoraSpec, cache_root: str | Path | None = None) -> LoraPolicy:
    """A LoRA policy whose frozen base is `policy`'s bf16 serving weights, with a fresh adapter
    (peft's init: B = 0, so it starts as exactly the base) and the same tokenizer id. The base's
    files (config, tokenizer, `model.safetensors`) go into the content-addressed cache
    (policy/hf_files.py)."""
    from safetensors.torch import save

    from policy.hf_files import WEIGHTS_FILE, files_sha256, materialize, pack, resolve

    if isinstance(policy, LoraPolicy):
        raise ValueError("the policy is a LoRA policy already")
    src = resolve(policy.config.model_dir, policy.config.files_sha256)
    files, _ = pack(src)
    files[WEIGHTS_FILE] = save(policy.serving_state_dict(), metadata={"format": "pt"})
    path = materialize(files, cache_root)
    name = policy.config.name or policy.tokenizer.name.rsplit("@", 1)[0]  # the same tokenizer id
    config = policy.config.model_copy(
        update={"model_dir": None, "files_sha256": files_sha256(files), "lora": spec, "name": name}
    )
    if cache_root is not None:
        config = config.model_copy(update={"model_dir": str(path)})
    return LoraPolicy(config)


def with_lora_setting(
    policy: HFPolicy | Any, want: dict[str, Any] | None, source: str, convert: bool = True
) -> Any:
    """`policy` as the trainer's LoRA setting `want` (FLYWHEEL_TRAINER_LORA, None = full fine-tuning)
    asks: a full HF policy becomes the base of a fresh adapter (`to_lora`, when `convert`), a LoRA
    policy must have exactly that adapter shape, anything else is a ValueError naming the variable
    and `source` (where the policy came from: a registered version, the trainer's state)."""
    have = policy.config_dict().get("lora")
    if want is None:
        if have is not None:
            raise ValueError(
                f"{source} is a LoRA policy ({json.dumps(have, sort_keys=True)}) and "
                "FLYWHEEL_TRAINER_LORA is unset: set it to that adapter to continue training it"
            )
        return policy
    spec = LoraSpec(**want)
    if have is not None:
        if LoraSpec(**have) != spec:
            raise ValueError(
                f"FLYWHEEL_TRAINER_LORA {json.dumps(spec.model_dump(), sort_keys=True)} differs "
                f"from the adapter of {source} ({json.dumps(have, sort_keys=True)})"
            )
        return policy
    if not isinstance(policy, HFPolicy):
        raise ValueError(
            f"FLYWHEEL_TRAINER_LORA needs a Hugging Face policy; {source} is type "
            f"{policy.config_dict().get('type', 'moe-byte')!r}"
        )
    if not convert:
        raise ValueError(
            f"FLYWHEEL_TRAINER_LORA is set but {source} is a full fine-tuning state: start "
            "with a new trainer state directory (the registry's versions are kept)"
        )
    try:
        lora = to_lora(policy, spec)
    except LoraTargetError as exc:
        raise ValueError(f"FLYWHEEL_TRAINER_LORA: {exc}") from None
    log.info(
        "LoRA (r=%d, alpha=%g) on %s: %d adapter parameters, base frozen",
        spec.r,
        spec.alpha,
        source,
        sum(p.numel() for p in lora.adapter_parameters()),
    )
    return lora


def export_dir(policy: HFPolicy, out: str | Path, merged: bool = False) -> Path:
    """Write `out/`, a directory `AutoModelForCausalLM.from_pretrained` loads (config, tokenizer,
    safetensors). A LoRA policy: `merged` = the adapter merged into the base (fp32 weights), else the
    base plus `out/adapter/` for `PeftModel.from_pretrained(model, out / "adapter")`. A full policy:
    its bf16 serving weights (`merged` changes nothing)."""
    from safetensors.torch import save_file

    from policy.hf_files import HF_FILES, WEIGHTS_FILE, resolve

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(policy, LoraPolicy):
        src = policy.base_dir()
    else:
        src = resolve(policy.config.model_dir, policy.config.files_sha256)
    for name in HF_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    if not isinstance(policy, LoraPolicy):
        save_file(policy.serving_state_dict(), str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    elif merged:
        policy.merged_model().save_pretrained(str(out))
    else:
        shutil.copy2(src / WEIGHTS_FILE, out / WEIGHTS_FILE)
        policy.save_adapter(out / "adapter")
    return out
