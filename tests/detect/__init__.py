"""Tests of rehydrate.detect (see tests/conftest.py for the layout)."""
