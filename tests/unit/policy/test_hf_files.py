"""policy/hf_files.py: an HF policy rebuilt from its non-weight files (content-addressed
cache directory) plus its serving weights equals the source directory's policy bit for bit, and a
cache directory whose files do not hash to the config's `files_sha256` is refused."""

from __future__ import annotations

import pytest
import torch


def _bits(sd: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: v.contiguous().view(torch.uint8).numpy().tobytes() for k, v in sd.items()}


def test_a_policy_from_the_cache_dir_and_serving_weights_equals_the_source(
    hf_moe_dir, tmp_path, monkeypatch
):
    from policy import build_policy
    from policy.hf_files import HF_FILES, materialize, pack

    source = build_policy({"type": "hf", "model_dir": str(hf_moe_dir)}).eval()
    files, sha = pack(hf_moe_dir)
    assert "config.json" in files and "tokenizer.json" in files
    assert set(files) <= set(HF_FILES) and not any(n.endswith(".safetensors") for n in files)
    path = materialize(files, tmp_path / "cache")
    assert path == tmp_path / "cache" / sha
    assert materialize(files, tmp_path / "cache") == path  # reused, not written twice

    cfg = {
        **source.config_dict(),
        "model_dir": None,
        "files_sha256": sha,
        "name": source.tokenizer.name.split("@")[0],
    }
    monkeypatch.setenv(
        "FLYWHEEL_DATA_DIR", str(tmp_path)
    )  # default cache root: <data_dir>/hf-models
    materialize(files, tmp_path / "hf-models")
    rebuilt = build_policy(cfg).eval()
    rebuilt.load_serving_state_dict(source.serving_state_dict())
    assert _bits(rebuilt.serving_state_dict()) == _bits(source.serving_state_dict())
    assert rebuilt.tokenizer.name == source.tokenizer.name
    assert rebuilt.config_dict()["files_sha256"] == sha
    prompt = [source.tokenizer.encode("def add(a, b):")]
    with torch.no_grad():
        a = source.logprobs(prompt, [[5, 6, 7]])
        b = rebuilt.logprobs(prompt, [[5, 6, 7]])
    assert torch.equal(a, b)


def test_a_cache_dir_that_does_not_hash_to_files_sha256_is_refused(hf_llama_dir, tmp_path):
    from policy import build_policy
    from policy.hf_files import HFFilesError, materialize, pack, resolve

    files, sha = pack(hf_llama_dir)
    path = materialize(files, tmp_path)
    assert resolve(None, sha, tmp_path) == path
    (path / "tokenizer.json").write_bytes(files["tokenizer.json"] + b" ")
    with pytest.raises(HFFilesError, match="hash to"):
        resolve(None, sha, tmp_path)
    assert materialize(files, tmp_path) == path  # a damaged entry is written again
    assert resolve(None, sha, tmp_path) == path
    with pytest.raises(HFFilesError, match="not materialized"):
        resolve(None, "0" * 64, tmp_path)
    with pytest.raises(HFFilesError, match="model_dir or files_sha256"):
        build_policy({"type": "hf"})
