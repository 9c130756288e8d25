"""The worlds ``python -m hotfix repro`` and the test suite run the bug report's races in.

They import only vLLM, torch, transformers (where a world builds a model), aiohttp (the serving
world's router; vLLM's API server needs it too) and the stdlib, so a bundle carries them. Kept free of vLLM imports here, so that ``tracker`` and ``timeline``
load without vLLM; ``scheduler_world`` and ``connectors`` import vLLM. Nothing in the rest of
the package imports them: a production process never loads a world.
"""
