"""Test-only helpers around the worlds of ``hotfix.worlds``: hypothesis timelines, shifted
vLLM trees, and verdict helpers."""
