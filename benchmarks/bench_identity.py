"""Cost of the identity phases (ENTROPY + SECRETS) on a typical set, per restore.

The set: every generator reseeded (``random``, NumPy's global state and a registered
``Generator`` when NumPy is installed, torch's CPU generator when torch is installed,
a registered ``random.Random``, tempfile, ssl), 4 ephemeral keys (2 Ed25519, 1 X25519,
1 EC P-256), 1 self-signed EC P-256 certificate loaded into a live server
``SSLContext``, 1 file certificate (PEM cert + key + CA bundle, validated), 1 file
``Secret``. Measured: the sum of the ENTROPY and SECRETS hook durations of each real
(simulated) restore, median over many restores; the before-snapshot pass (drop/wipe);
RSA key regeneration, which is reported separately (pure-Python prime search from kernel
entropy, see docs/identity.md).
"""

from __future__ import annotations

import datetime as dt
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rehydrate import entropy, keys, tls  # noqa: E402 - after the sys.path insert
from rehydrate._hooks import Phase  # noqa: E402
from rehydrate.secrets import Secret  # noqa: E402
from rehydrate.testing import isolated_engine  # noqa: E402

GOAL_MS = 20.0
RESTORES = 40


def _ca_files(d: Path) -> dict[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench CA")])
    ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(days=1))
          .not_valid_after(now + dt.timedelta(days=30))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "svc")]))
            .issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=10))
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    (d / "tls.crt").write_bytes(leaf.public_bytes(pem))
    (d / "tls.key").write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    (d / "ca.crt").write_bytes(ca.public_bytes(pem))
    return {"cert": str(d / "tls.crt"), "key": str(d / "tls.key"), "ca": str(d / "ca.crt")}


def _phase_ms(report, phases) -> float:
    return sum(h.duration for h in report.hooks if h.phase in phases) * 1000


def run() -> list[tuple[str, str, str]]:
    extras = []
    try:
        import numpy as np

        extras.append("numpy")
    except ImportError:
        np = None
    try:
        import torch  # noqa: F401 - imported so that its generator is reseeded

        extras.append("torch")
    except ImportError:
        pass
    rows: list[tuple[str, str, str]] = []
    engine = isolated_engine()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            entropy.register(random.Random(), engine=engine)
            if np is not None:
                gen = np.random.default_rng()
                entropy.register(gen, engine=engine)
            handles = [keys.ephemeral(f"k{i}", alg, engine=engine) for i, alg in
                       enumerate(["ed25519", "ed25519", "x25519", "ec-p256"])]
            cert = tls.self_signed("web", engine=engine)
            live_ctx = cert.server_context()  # kept alive: the snapshot pass replaces its key
            tls.from_files("files", **_ca_files(d), watch=False, engine=engine)
            (d / "secret").write_bytes(b"s3cret-value")
            secret = Secret.from_file(d / "secret", engine=engine)

            ent, sec, total, snap = [], [], [], []
            for _ in range(RESTORES):
                s = engine.simulate_snapshot()
                r = engine.simulate_restore()
                assert r.ok and s.ok, r.table()
                ent.append(_phase_ms(r, {Phase.ENTROPY}))
                sec.append(_phase_ms(r, {Phase.SECRETS}))
                total.append(r.duration * 1000)
                snap.append(s.duration * 1000)
            assert secret.get() == b"s3cret-value" and all(not h.dropped for h in handles)
            assert live_ctx is not None and not cert.key_dropped
            both = [a + b for a, b in zip(ent, sec, strict=True)]
            med = statistics.median(both)
            rows += [
                (f"ENTROPY + SECRETS phases, typical set (median of {RESTORES})",
                 f"{med:.2f} ms", f"< {GOAL_MS:g} ms"),
                (f"  ENTROPY (random, tempfile, ssl{', ' + ', '.join(extras) if extras else ''},"
                 " 2 registered)", f"{statistics.median(ent):.2f} ms", "info"),
                ("  SECRETS (4 EC/Ed25519 keys, 1 self-signed, 1 file cert, 1 secret)",
                 f"{statistics.median(sec):.2f} ms", "info"),
                ("  p90 of ENTROPY + SECRETS", f"{sorted(both)[int(len(both) * 0.9)]:.2f} ms",
                 "info"),
                ("whole restore run incl. engine overhead (median)",
                 f"{statistics.median(total):.2f} ms", "info"),
                ("before-snapshot pass: drop keys, cert keys (1 live ctx), wipe secret",
                 f"{statistics.median(snap):.2f} ms", "info"),
            ]
        for bits, n in ((2048, 5), (3072, 3)):
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                keys.generate_private_key(f"rsa-{bits}")
                times.append((time.perf_counter() - t0) * 1000)
            rows.append((f"RSA-{bits} key from kernel entropy (median of {n}, max)",
                         f"{statistics.median(times):.0f} ms (max {max(times):.0f})",
                         "reported separately"))
    finally:
        engine.close()
    return rows


if __name__ == "__main__":  # the same table as `make bench`, for this module only
    from run import main  # benchmarks/ is on sys.path when a module runs as a script

    sys.exit(main([*sys.argv[1:], Path(__file__).stem]))
