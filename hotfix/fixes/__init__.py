"""One module per fix. Each starts with ``SPEC = FixSpec(...)`` (see ``hotfix.registry``)
followed by its wrapper functions; ``registry.fix_modules`` discovers them. A fix module
must not import vLLM or torch at import time: ``python -m hotfix status`` reads the specs.
"""
