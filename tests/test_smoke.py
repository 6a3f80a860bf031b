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
