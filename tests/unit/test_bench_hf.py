"""Smoke tests of the HF benchmarks (bench/hf_models.py, bench/delta.py --model hf-*,
bench/hf_invariance.py, bench/lora_delta.py) at tiny sizes (`--tiny`: hidden 64, 2 layers), so CI
runs their code paths. They assert what the benchmarks compute (bit-exact decoding, exactly zero
invariant mismatch, the tables' rows), never a timing. The model cache goes to a temporary
directory instead of bench/.cache."""

from __future__ import annotations

import re
import sys

import pytest
import torch


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path_factory, monkeypatch):
    from bench import hf_models

    monkeypatch.setattr(hf_models, "CACHE", tmp_path_factory.getbasetemp() / "hf-bench-cache")
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _run(module, argv: list[str], capsys, monkeypatch) -> str:
    monkeypatch.setattr(sys, "argv", [module.__name__, *argv])
    module.main()
    return capsys.readouterr().out


def test_built_model_is_cached_trained_and_loads_through_the_hf_policy():
    from bench.hf_models import HFTrainer, model_dir
    from policy import build_policy

    path = model_dir("hf-moe", "tiny")
    for f in ("config.json", "model.safetensors", "tokenizer.json", "optimizer.pt"):
        assert (path / f).is_file(), f"{f} missing from {path}"
    mtime = (path / "optimizer.pt").stat().st_mtime
    assert model_dir("hf-moe", "tiny") == path and (path / "optimizer.pt").stat().st_mtime == mtime
    policy = build_policy({"type": "hf", "model_dir": str(path)})
    assert policy.moe_spec is not None, "the hf-moe model has MoE routers"
    tr = HFTrainer("hf-moe", batch=2, seq=8, size="tiny")
    assert tr.opt.state_dict()["state"], "Adam moments restored from the cache, not at init"
    before = tr.serving()
    tr.step(1e-3)
    after = tr.serving()
    assert set(before) == set(after) and any(not torch.equal(before[k], after[k]) for k in before)


def test_delta_bench_on_an_hf_model_prints_ratios_and_anchors(capsys, monkeypatch):
    from bench import delta

    out = _run(
        delta,
        ["--model", "hf-dense", "--tiny", "--lrs", "1e-6", "--steps", "1", "--no-sync"],
        capsys,
        monkeypatch,
    )
    assert "published anchors: TRL" in out and "PULSE" in out
    m = re.search(r"1e-06\* -> (\d+)x", out)
    assert m and int(m.group(1)) >= 1, out


def test_invariance_bench_reports_zero_invariant_mismatch(capsys, monkeypatch):
    from bench import hf_invariance

    out = _run(
        hf_invariance,
        ["--tiny", "--models", "hf-dense,hf-moe", "--repeats", "1", "--gen-tokens", "6"],
        capsys,
        monkeypatch,
    )
    assert "generate() == logprobs() bit for bit on every HF model" in out
    for model in ("hf-dense", "hf-moe"):
        assert re.search(rf"{model} .* invariant .* 0 .* 0 .* 0\.0%", out), out
        assert re.search(rf"{model} .* invariant int8 .*x", out), out


def test_invariance_bench_fails_loudly_on_a_mismatch(capsys, monkeypatch):
    from bench import hf_invariance

    real = hf_invariance.mismatch

    def off_by_one_ulp(policy, prompts, max_tokens):
        r = real(policy, prompts, max_tokens)
        return {**r, "max": r["max"] + 1e-7}

    monkeypatch.setattr(hf_invariance, "mismatch", off_by_one_ulp)
    with pytest.raises(SystemExit) as exc:
        _run(
            hf_invariance,
            ["--tiny", "--models", "hf-dense", "--repeats", "1", "--gen-tokens", "4"],
            capsys,
            monkeypatch,
        )
    assert exc.value.code == 1
    assert "FAILED" in capsys.readouterr().out


def test_lora_bench_measures_adapter_and_its_delta(capsys, monkeypatch):
    from bench import lora_delta

    out = _run(
        lora_delta,
        ["--tiny", "--ranks", "8", "--lrs", "1e-4", "--steps", "1", "--warmup", "1"],
        capsys,
        monkeypatch,
    )
    experts = {
        m: int(n.replace(",", ""))
        for m, n in re.findall(r"(hf-\w+) r=8: [\d,]+ adapter parameters \(([\d,]+) on fused", out)
    }
    # the MoE adapter covers the fused experts (peft target_parameters); the dense model has none
    assert experts["hf-dense"] == 0 and experts["hf-moe"] > 0, out
    assert len(re.findall(r"hf-(?:dense|moe) .* 8 .* 0\.0001 .* 1 .*x", out)) == 2, out
