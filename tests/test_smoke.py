import rehydrate


def test_simulated_restore_runs_hooks_in_phase_order(rehydrate_engine):
    calls = []
    reg = rehydrate_engine.registry
    reg.after_restore(lambda: calls.append("app"))
    reg.after_restore(phase=rehydrate.Phase.ENTROPY)(lambda: calls.append("entropy"))
    report = rehydrate_engine.simulate_restore()
    assert report.ok
    assert calls == ["entropy", "app"]
    assert rehydrate_engine.status().generation == 1


def test_package_all_covers_the_module_level_api():
    """``rehydrate.__all__`` repeats ``rehydrate._api.__all__`` literally (mypy and ruff see
    re-exports only in a literal list); this keeps the two in step."""
    from rehydrate import _api as api

    assert set(api.__all__) <= set(rehydrate.__all__)
    assert len(rehydrate.__all__) == len(set(rehydrate.__all__))
    for name in rehydrate.__all__:  # bound, or loaded on first use (without loading it)
        assert name in vars(rehydrate) or name in rehydrate._LAZY_NAMES, name
