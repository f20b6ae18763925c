"""Tiny Hugging Face model directories built offline, exactly as a user would hand them to Flywheel.

Nothing is downloaded: a byte-level BPE tokenizer is trained with `tokenizers` on this repository's
own text, and the models are random `LlamaConfig` (dense) / `Qwen2MoeConfig` (MoE) instances saved
with `save_pretrained` (config.json + model.safetensors) next to the tokenizer files. Shared by tests
(tests/unit/policy/conftest.py caches one directory of each per session) and benchmarks.

    tok_dir = train_bpe_tokenizer("/tmp/tok")            # tokenizer.json, tokenizer_config.json, ...
    llama = tiny_llama_dir("/tmp/llama", tok_dir)          # + config.json, model.safetensors
    moe = tiny_qwen2_moe_dir("/tmp/moe", tok_dir)          # 2 MoE layers, 4 experts, top-2
    chars = char_tokenizer("/tmp/chars")                   # ASCII characters, Qwen2.5's template

The tokenizer: ByteLevel BPE (every string encodes), special tokens `<|bos|>`, `<|eos|>`,
`<|pad|>`, and a chat template that renders each message as `<role>: <content>\\n` and ends with
`assistant: ` where the reply begins.
"""

from __future__ import annotations

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# Qwen2.5's own template (tests/data/chat_templates/README.md): tools and Hermes `<tool_call>` calls
QWEN25_TEMPLATE = (REPO / "tests" / "data" / "chat_templates" / "qwen2.5.jinja").read_text()
TEXT_DIRS = (
    "app",
    "trainer",
    "policy",
    "kernels",
    "docs",
)  # the training text: these folders' .py and .md


def _training_files() -> list[str]:
    files = sorted(
        str(p)
        for d in TEXT_DIRS
        for p in (REPO / d).rglob("*")
        if p.suffix in (".py", ".md") and p.is_file()
    )
    assert files, f"no .py/.md files under {TEXT_DIRS} of {REPO}"
    return files


def train_bpe_tokenizer(
    out_dir: str | Path, vocab_size: int = 300, chat_template: str = CHAT_TEMPLATE
) -> Path:
    """Train a byte-level BPE tokenizer on the repo's text and save it as a `PreTrainedTokenizerFast`
    with `chat_template` (QWEN25_TEMPLATE: tools and `<tool_call>` calls, as Qwen2.5 renders them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_training_files(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    fast.chat_template = chat_template
    fast.save_pretrained(str(out))
    return out


def char_tokenizer(out_dir: str | Path, chat_template: str = QWEN25_TEMPLATE) -> Path:
    """A character-level tokenizer (printable ASCII, no merges) with eos `<|eos|>` as its only
    special token and `<tool_call>` / `</tool_call>` as tokens of their own (as in Qwen2.5's
    vocabulary), saved with `chat_template`.

    For sessions of an untrained model (tests/e2e/test_hf_agents.py): any sequence it samples
    decodes to text that encodes back to the same tokens, so a session's next prompt extends the
    last one token for token (a BPE tokenizer's random samples re-encode otherwise, and the session
    ledger breaks the trajectory there); and with about 100 tokens it writes `<tool_call>` now and
    then, so some sessions go on past their first turn."""
    import string

    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {EOS: 0, **{c: i + 1 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(EOS, special=True)])
    tok.add_tokens([AddedToken(t, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.chat_template = chat_template
    fast.save_pretrained(str(out))
    return out


def _save_model(config, path: str | Path, tokenizer_dir: str | Path, seed: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out))
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file():
            shutil.copy2(f, out / f.name)
    return out


def _special_ids(tokenizer_dir: str | Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return {
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }


def tiny_llama_dir(
    path: str | Path,
    tokenizer_dir: str | Path,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    head_dim: int = 16,
    max_positions: int = 256,
) -> Path:
    """A dense Llama (2 layers, 4 heads of `head_dim`: hidden 64 by default, 256 with the head_dim
    64 vLLM's CPU attention needs) with random weights, saved with its tokenizer
    (`tie_word_embeddings`: lm_head shares the input embedding, which save_pretrained writes once)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=4 * head_dim,
        intermediate_size=8 * head_dim,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings,
        **_special_ids(tokenizer_dir),
    )
    return _save_model(config, path, tokenizer_dir, seed)


def tiny_qwen2_moe_dir(
    path: str | Path, tokenizer_dir: str | Path, seed: int = 0, head_dim: int = 16
) -> Path:
    """A Qwen2-MoE (2 layers, 4 heads of `head_dim`, 4 experts top-2 + a shared expert in every
    layer) with random weights, saved with its tokenizer. vLLM's CPU attention needs head_dim 64
    (then hidden is 256)."""
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(
        hidden_size=4 * head_dim,
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=256,
        **_special_ids(tokenizer_dir),
    )
    return _save_model(config, path, tokenizer_dir, seed)
