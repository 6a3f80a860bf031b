"""Tests of rehydrate.adapters (see tests/conftest.py for the layout)."""
