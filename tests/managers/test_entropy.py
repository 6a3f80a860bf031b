"""ENTROPY phase: reseeding after a (simulated) restore, instance_id, tempfile, disabling.

Each test compares the generator after a restore with a *copy of its pre-restore state*:
that copy is exactly what a clone of the snapshot would hold, so "differs from the copy"
is "a clone would not repeat its parent's stream".
"""

from __future__ import annotations

import random
import subprocess
import sys
import tempfile
import textwrap

import pytest

import rehydrate
from rehydrate import entropy


def _stream(r: random.Random, n: int = 8) -> list[float]:
    return [r.random() for _ in range(n)]


def _clone_global_random() -> random.Random:
    copy = random.Random()
    copy.setstate(random.getstate())
    return copy


def test_entropy_hook_is_installed_by_default(rehydrate_engine):
    names = [h.name for h in rehydrate_engine.hooks("restore")]
    assert "rehydrate.entropy" in names
    entropy_hook = next(h for h in rehydrate_engine.hooks("restore")
                        if h.name == "rehydrate.entropy")
    assert entropy_hook.phase is rehydrate.Phase.ENTROPY


def test_global_random_is_reseeded(rehydrate_engine):
    clone = _clone_global_random()
    report = rehydrate_engine.simulate_restore()
    assert report.ok
    assert _stream(random) != _stream(clone)


def test_disabled_by_env_keeps_streams_identical(rehydrate_engine, monkeypatch):
    """The control case: without the phase a clone repeats its parent's stream."""
    monkeypatch.setenv("REHYDRATE_DISABLE", "entropy,secrets")
    clone = _clone_global_random()
    before = rehydrate.instance_id()
    assert rehydrate_engine.simulate_restore().ok
    assert _stream(random) == _stream(clone)
    assert rehydrate.instance_id() == before


def test_disabled_by_a_restored_environment(rehydrate_engine):
    """REHYDRATE_DISABLE is read after the ENVIRONMENT phase applied the new env."""
    clone = _clone_global_random()
    assert rehydrate_engine.simulate_restore(env={"REHYDRATE_DISABLE": "entropy"}).ok
    assert _stream(random) == _stream(clone)


def test_disabled_by_engine_option(rehydrate_engine):
    entropy.manager(rehydrate_engine).enabled = False
    clone = _clone_global_random()
    assert rehydrate_engine.simulate_restore().ok
    assert _stream(random) == _stream(clone)


def test_registered_random_instances(rehydrate_engine):
    mine = random.Random(42)
    other = random.Random(42)
    entropy.register(mine, engine=rehydrate_engine)
    rehydrate_engine.simulate_restore()
    other_stream = _stream(other)
    assert _stream(mine) != other_stream
    # an unregistered generator is the user's business: untouched
    assert other_stream == _stream(random.Random(42))


def test_registered_random_instances_are_held_weakly(rehydrate_engine):
    import gc

    r = random.Random(1)
    entropy.register(r, engine=rehydrate_engine)
    del r
    gc.collect()
    assert rehydrate_engine.simulate_restore().ok
    # only the global generator was reseeded: the dropped instance was forgotten
    assert entropy.manager(rehydrate_engine).last.count("random") == 1
    assert entropy.manager(rehydrate_engine)._objects == {}


def test_registered_callable_gets_fresh_seed_bytes(rehydrate_engine):
    seeds: list[bytes] = []
    entropy.register(seeds.append, engine=rehydrate_engine)
    rehydrate_engine.simulate_restore()
    rehydrate_engine.simulate_restore()
    assert len(seeds) == 2 and len(seeds[0]) == 32 and seeds[0] != seeds[1]


def test_unsupported_object_is_refused(rehydrate_engine):
    with pytest.raises(TypeError, match="cannot reseed"):
        entropy.register(object(), engine=rehydrate_engine)


def test_failing_reseed_fails_the_hook(rehydrate_engine):
    def broken(seed: bytes) -> None:
        raise OSError("device gone")

    entropy.register(broken, engine=rehydrate_engine)
    report = rehydrate_engine.simulate_restore()
    assert not report.ok
    [res] = [h for h in report.hooks if h.name == "rehydrate.entropy"]
    assert res.outcome == "failed" and "device gone" in str(res.error)
    # the global generator was still reseeded before the failure was reported
    assert "random" in entropy.manager(rehydrate_engine).last


def test_instance_id_changes_on_restore_not_on_resume(rehydrate_engine):
    first = rehydrate.instance_id()
    rehydrate_engine.simulate_restore()
    second = rehydrate.instance_id()
    assert second != first
    rehydrate_engine.simulate_restore(kind="resume")
    assert rehydrate.instance_id() == second
    import uuid

    assert uuid.UUID(second).version == 4


def test_instance_id_is_process_wide_and_any_engine_renews_it(rehydrate_engine):
    """Documented (docs/identity.md): one ID per process, whichever engine restores."""
    from rehydrate.testing import isolated_engine

    other = isolated_engine()
    try:
        before = other.status().extra["entropy"]["instance_id"]
        assert before == rehydrate.instance_id()
        rehydrate_engine.simulate_restore()  # an isolated engine's (simulated) restore ...
        after = rehydrate.instance_id()
        assert after != before
        # ... changes the ID every engine (and the module-level function) reports
        assert other.status().extra["entropy"]["instance_id"] == after
        assert entropy.instance_id() == after
    finally:
        other.close()


def test_instance_id_listener(rehydrate_engine):
    seen: list[str] = []
    entropy.on_instance_id_change(seen.append)
    try:
        rehydrate_engine.simulate_restore()
    finally:
        entropy._id_listeners.remove(seen.append)
    assert seen == [rehydrate.instance_id()]


def test_tempfile_name_sequence_is_reset(rehydrate_engine, tmp_path):
    seq = tempfile._get_candidate_names()
    next(seq)  # make sure its rng exists for this PID
    saved = seq.rng.getstate()
    copy = random.Random()
    copy.setstate(saved)
    expected = ["".join(copy.choices(seq.characters, k=8)) for _ in range(4)]

    rehydrate_engine.simulate_restore()
    fd, path = tempfile.mkstemp(dir=tmp_path)
    import os

    os.close(fd)
    new_seq = tempfile._get_candidate_names()
    assert new_seq is not seq
    got = [os.path.basename(path)[3:]] + [next(new_seq) for _ in range(3)]
    assert got != expected
    assert os.path.basename(path)[3:] not in expected


def test_tempfile_without_reset_would_repeat(monkeypatch):
    """Why the reset is needed: the same PID means the cloned sequence continues."""
    seq = tempfile._get_candidate_names()
    next(seq)
    copy = random.Random()
    copy.setstate(seq.rng.getstate())
    assert next(seq) == "".join(copy.choices(seq.characters, k=8))


def test_restore_feeds_fresh_kernel_bytes_to_ssl_rand_add(rehydrate_engine, monkeypatch):
    """Checks what rehydrate does — 32 fresh bytes per restore handed to ``ssl.RAND_add`` —
    not its effect: whether the system OpenSSL's DRBG output then differs between clones
    that keep their PID cannot be observed in one process (a fork changes the PID, which
    makes OpenSSL reseed by itself), and no end-to-end test samples it."""
    import ssl

    fed: list[tuple[bytes, float]] = []
    real = ssl.RAND_add
    monkeypatch.setattr(ssl, "RAND_add", lambda b, e: (fed.append((bytes(b), e)), real(b, e)))
    rehydrate_engine.simulate_restore()
    rehydrate_engine.simulate_restore()
    assert [(len(b), e) for b, e in fed] == [(32, 32.0), (32, 32.0)]
    assert fed[0][0] != fed[1][0]  # fresh bytes each time, not a constant
    assert "ssl" in entropy.manager(rehydrate_engine).last


# -- NumPy -------------------------------------------------------------------------------


def test_numpy_global_and_registered_generators(rehydrate_engine):
    np = pytest.importorskip("numpy")
    np.random.seed(7)
    legacy_copy = np.random.RandomState()
    legacy_copy.set_state(np.random.get_state())
    gen = np.random.default_rng(7)
    gen_copy = np.random.default_rng(7)
    unregistered = np.random.default_rng(7)
    rs = np.random.RandomState(7)
    rs_copy = np.random.RandomState(7)
    entropy.register(gen, engine=rehydrate_engine)
    entropy.register(rs, engine=rehydrate_engine)

    assert rehydrate_engine.simulate_restore().ok
    assert "numpy" in entropy.manager(rehydrate_engine).last
    assert list(np.random.random(4)) != list(legacy_copy.random_sample(4))
    assert list(gen.random(4)) != list(gen_copy.random(4))
    assert list(rs.random_sample(4)) != list(rs_copy.random_sample(4))
    assert list(unregistered.random(4)) == list(np.random.default_rng(7).random(4))
    assert type(gen.bit_generator).__name__ == "PCG64"  # the kind of generator is kept


def test_a_random_state_over_any_bit_generator_is_reseeded_and_keeps_its_kind(
        rehydrate_engine):
    np = pytest.importorskip("numpy")
    rs = np.random.RandomState(np.random.PCG64(7))
    rs_copy = np.random.RandomState(np.random.PCG64(7))
    rs.random_sample(3)  # mid-stream, with a cached gauss below
    rs_copy.random_sample(3)
    rs.standard_normal()
    rs_copy.standard_normal()
    entropy.register(rs, engine=rehydrate_engine)
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert list(rs.random_sample(4)) != list(rs_copy.random_sample(4))
    assert rs.get_state(legacy=False)["bit_generator"] == "PCG64"
    assert rs.get_state(legacy=False)["has_gauss"] == 0  # no cached pre-restore normal


def test_numpy_generator_spawn_children_differ_between_clones(rehydrate_engine):
    """The bit generator's state was replaced but its SeedSequence kept: two clones drew
    differently from ``gen`` yet got identical ``gen.spawn()`` children."""
    np = pytest.importorskip("numpy")
    from detect_helpers import in_forked_child

    gens = [np.random.default_rng(7), np.random.Generator(np.random.MT19937(7))]
    for gen in gens:
        entropy.register(gen, engine=rehydrate_engine)

    def clone() -> dict:  # type: ignore[type-arg]
        assert rehydrate_engine.simulate_restore().ok
        return {"own": [int(g.integers(2**62)) for g in gens],
                "child": [int(g.spawn(1)[0].integers(2**62)) for g in gens],
                "entropy": [str(g.bit_generator.seed_seq.entropy) for g in gens],
                "kind": [type(g.bit_generator).__name__ for g in gens]}

    first, second = in_forked_child(clone), in_forked_child(clone)
    assert first["kind"] == second["kind"] == ["PCG64", "MT19937"]
    for key in ("own", "child", "entropy"):
        assert all(a != b for a, b in zip(first[key], second[key], strict=True)), key


def test_a_numpy_without_seed_sequence_pickling_reseeds_the_state_and_warns_once(
        rehydrate_engine, caplog, monkeypatch):
    """NumPy 1.25/1.26 have spawn() but pickle the state only: the state is still
    reseeded, and one warning says the spawn() children are not."""
    import logging

    np = pytest.importorskip("numpy")

    class OldBitGenerator:  # what numpy 1.26's bit generator offers for this
        def __init__(self, seed_seq: object) -> None:
            self.state = {"seed": seed_seq}

        def __getstate__(self) -> dict:  # type: ignore[type-arg]
            return self.state

        def spawn(self, n: int) -> list:  # type: ignore[type-arg]
            return []

    class Generator:
        def __init__(self) -> None:
            self.bit_generator = OldBitGenerator("parent")

    Generator.__module__ = "numpy.random._generator"
    monkeypatch.setattr(entropy, "_spawn_warned", False, raising=False)
    caplog.set_level(logging.WARNING, logger="rehydrate")
    gens = [entropy.register(Generator(), engine=rehydrate_engine) for _ in range(2)]
    assert rehydrate_engine.simulate_restore().ok
    assert rehydrate_engine.simulate_restore().ok
    assert all(isinstance(g.bit_generator.state["seed"], np.random.SeedSequence)
               for g in gens)
    lines = [r.getMessage() for r in caplog.records if "spawn()" in r.getMessage()]
    assert len(lines) == 1 and "numpy >= 2.0" in lines[0]


def test_numpy_generators_are_held_strongly_until_unregistered(rehydrate_engine, caplog):
    """NumPy generators support no weak references: rehydrate keeps them alive (and says
    so once, at debug level) until unregister()."""
    import gc
    import logging

    np = pytest.importorskip("numpy")
    entropy._strong_logged.clear()
    caplog.set_level(logging.DEBUG, logger="rehydrate")
    entropy.register(np.random.default_rng(), engine=rehydrate_engine)  # no reference kept
    kept = entropy.register(np.random.default_rng(), engine=rehydrate_engine)
    gc.collect()
    assert rehydrate_engine.simulate_restore().ok
    assert entropy.manager(rehydrate_engine).last.count("numpy-generator") == 2
    lines = [r.getMessage() for r in caplog.records if "weak references" in r.getMessage()]
    assert len(lines) == 1 and "held strongly" in lines[0]
    entropy.unregister(kept, engine=rehydrate_engine)
    assert rehydrate_engine.simulate_restore().ok
    assert entropy.manager(rehydrate_engine).last.count("numpy-generator") == 1


def test_numpy_is_never_imported_by_rehydrate():
    code = textwrap.dedent("""
        import sys
        import rehydrate
        from rehydrate.testing import isolated_engine
        e = isolated_engine()
        assert e.simulate_restore().ok
        assert rehydrate.simulate_restore().ok
        bad = [m for m in ("numpy", "torch") if m in sys.modules]
        assert not bad, bad
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                         text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# -- torch ---------------------------------------------------------------------------------


def test_torch_cpu_generators(rehydrate_engine):
    """Needs torch (not in the dev extra: ~700 MB installed). Skipped honestly otherwise."""
    torch = pytest.importorskip("torch", reason="torch not installed: torch reseeding "
                                "untested here (pip install torch==2.13.0 to run it)")
    torch.manual_seed(3)
    state = torch.random.get_rng_state()
    g = torch.Generator().manual_seed(3)
    g_state = g.get_state()
    entropy.register(g, engine=rehydrate_engine)
    assert rehydrate_engine.simulate_restore().ok
    assert "torch" in entropy.manager(rehydrate_engine).last
    after = torch.rand(4)
    torch.random.set_rng_state(state)
    assert not torch.equal(after, torch.rand(4))
    after_g = torch.rand(4, generator=g)
    g.set_state(g_state)
    assert not torch.equal(after_g, torch.rand(4, generator=g))
    if not torch.cuda.is_available():
        assert not torch.cuda.is_initialized()  # reseeding never initialises CUDA


def test_an_unhashable_callable_can_be_registered_and_unregistered(rehydrate_engine):
    """It raised a bare "TypeError: unhashable type" (unregister already expected it)."""
    from rehydrate import entropy as entropy_module

    class Reseeder:
        __hash__ = None  # type: ignore[assignment]

        def __init__(self) -> None:
            self.seeds: list[bytes] = []

        def __call__(self, seed: bytes) -> None:
            self.seeds.append(seed)

    r = Reseeder()
    entropy_module.register(r, engine=rehydrate_engine)
    assert rehydrate_engine.simulate_restore().ok
    assert len(r.seeds) == 1 and len(r.seeds[0]) == 32
    entropy_module.unregister(r, engine=rehydrate_engine)
    assert rehydrate_engine.simulate_restore().ok
    assert len(r.seeds) == 1
