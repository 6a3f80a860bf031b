"""Tests of rehydrate.managers (see tests/conftest.py for the layout)."""
