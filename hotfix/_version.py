"""The hotfix's version: one place, importable from every layer (stdlib only)."""
__version__ = "0.1.0"
