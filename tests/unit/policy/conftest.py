"""Policy tests: tiny models, one intra-op thread; `tiny_policy` is a randomly initialised 2-layer MoE."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TINY = {
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 2,
    "d_ff": 48,
    "n_experts": 4,
    "top_k": 2,
    "max_context": 128,
}


@pytest.fixture
def tiny_config() -> dict:
    return dict(TINY)


@pytest.fixture
def tiny_policy():
    from policy import build_policy

    torch.manual_seed(0)
    return build_policy(dict(TINY)).eval()


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n byte prompts of mixed lengths (0..40 bytes) from a seeded RNG."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 41, (n,), generator=g).tolist()
    return [torch.randint(32, 127, (k,), generator=g).tolist() for k in lengths]


# --- Hugging Face model directories (tests/hf_models.py), built once per test session ---------------


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory):
    from tests.hf_models import train_bpe_tokenizer

    return train_bpe_tokenizer(tmp_path_factory.mktemp("hf-tokenizer"))


@pytest.fixture(scope="session")
def hf_llama_dir(tmp_path_factory, hf_tokenizer_dir):
    from tests.hf_models import tiny_llama_dir

    return tiny_llama_dir(tmp_path_factory.mktemp("hf-llama") / "tiny-llama", hf_tokenizer_dir)


@pytest.fixture(scope="session")
def hf_llama_tied_dir(tmp_path_factory, hf_tokenizer_dir):
    from tests.hf_models import tiny_llama_dir

    return tiny_llama_dir(
        tmp_path_factory.mktemp("hf-llama-tied") / "tiny-llama-tied",
        hf_tokenizer_dir,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="session")
def hf_moe_dir(tmp_path_factory, hf_tokenizer_dir):
    from tests.hf_models import tiny_qwen2_moe_dir

    return tiny_qwen2_moe_dir(
        tmp_path_factory.mktemp("hf-moe") / "tiny-qwen2-moe", hf_tokenizer_dir
    )
