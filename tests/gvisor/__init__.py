"""Tests that run workloads under real gVisor runsc (see harness.py)."""
