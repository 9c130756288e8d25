"""In-process test worlds around the real vLLM scheduler and KV connectors.

Kept free of vLLM imports so that `tests.worlds.tracker` and
`tests.worlds.timeline` load without vLLM; `scheduler_world` and
`connectors` import vLLM.
"""
