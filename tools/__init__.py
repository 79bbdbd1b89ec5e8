"""Repository tools (not installed): run each from the repository root as ``python -m tools.NAME``."""
