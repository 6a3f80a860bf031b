__version__ = "0.1.0.dev0"
"""This release of rehydrate (``rehydrate --version`` prints it)."""
