"""Seed a Hugging Face hub cache with config-only snapshots of the models vLLM's unit tests name.

    python3 .ci/hf_config_cache.py HF_HUB_CACHE

vLLM's scheduler and KV-connector unit tests build a `ModelConfig` for a hub model id
(`facebook/opt-125m` for nearly all of them) and never load weights or a tokenizer. CI reaches
no model hub, so each id gets the model's public `config.json` (architecture and sizes only) in
the cache layout huggingface_hub reads with HF_HUB_OFFLINE=1 (`models--ORG--NAME/refs/main`,
`snapshots/REV/config.json`). Tests that need weights or tokenizer files fail the same way in
both runs and are left out of the selection (.ci/legs/vllm-unit.tests). Stdlib only.
"""
import json
import sys
from pathlib import Path

REV = "0" * 40  # a fixed fake revision: the cache only needs refs/main to name a snapshot

CONFIGS = {
    "facebook/opt-125m": {
        "_name_or_path": "facebook/opt-125m", "activation_dropout": 0.0, "activation_function": "relu",
        "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
        "do_layer_norm_before": True, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072,
        "hidden_size": 768, "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048,
        "model_type": "opt", "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1,
        "prefix": "</s>", "torch_dtype": "float16", "transformers_version": "4.21.0.dev0",
        "use_cache": True, "vocab_size": 50272, "word_embed_proj_dim": 768,
    },
}


def main(cache: Path) -> int:
    for repo, config in CONFIGS.items():
        base = cache / f"models--{repo.replace('/', '--')}"
        snap = base / "snapshots" / REV
        snap.mkdir(parents=True, exist_ok=True)
        (base / "refs").mkdir(exist_ok=True)
        (base / "refs" / "main").write_text(REV)
        (snap / "config.json").write_text(json.dumps(config, indent=1))
    print(f"   hub cache {cache}: config-only {', '.join(CONFIGS)}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
