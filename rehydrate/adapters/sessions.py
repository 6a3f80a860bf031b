"""Session tokens and per-match secrets that differ in every clone of a snapshot.

A game server snapshotted mid-match and restored twice would hand both copies' players
the same session tokens: a token stolen from one match would work in the other, and the
"random" match keys are the same everywhere. :class:`MatchSessions` keys everything it
issues on a :class:`rehydrate.secrets.Secret` drawn from the kernel (``/dev/urandom``):
the secret is wiped before a snapshot and drawn again after every restore or resume (in
the ``SECRETS`` phase), so each clone signs with its own key and tokens issued before the
snapshot no longer verify anywhere — players rejoin.

::

    sessions = MatchSessions("match")
    token = sessions.token(player_id)          # give it to the player on join
    if not sessions.verify(player_id, token):  # on every input
        ask_to_rejoin(player_id)
    key = sessions.derive("chat-encryption")   # a per-match secret, per clone

While the secret is wiped (between the before-snapshot pass and the restore) the calls
raise :class:`rehydrate.secrets.SecretUnavailable` (``on_wiped="raise"``) so that an
asyncio game loop never blocks on it; ``verify`` returns False then.
"""

from __future__ import annotations

import base64
import numbers
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives import constant_time, hashes, hmac
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from rehydrate.extensions import shown
from rehydrate.keys import urandom_into
from rehydrate.secrets import Secret, SecretUnavailable

if TYPE_CHECKING:
    from rehydrate.extensions import Engine

__all__ = ["MatchSessions"]

_TOKEN_BYTES = 18  # 144 bits: unguessable, 24 base64url characters
MAX_KEY_BYTES = 1024
"""The largest key ``nbytes`` may ask for. HMAC-SHA256 hashes a key longer than 64 bytes
down to 32 anyway; a size far beyond this is a mistake (``2**40`` ran out of memory inside
the key's source, an error naming neither the argument nor the limit)."""


def _utf8(text: str) -> bytes:
    """``text`` as UTF-8, lone surrogates included: a client's JSON may carry ``"\\udcff"``
    (``json.loads`` accepts it), and strict UTF-8 would raise on it. ``surrogatepass`` is
    one-to-one, and no well-formed string encodes to the same bytes."""
    return text.encode("utf-8", "surrogatepass")


def _whole(value: object, low: int, high: int | None, rule: str) -> int:
    """``value`` as an int within ``low``..``high``, else ``ValueError`` "``rule``, not …".
    ``numbers.Integral``: a NumPy integer is a whole number too; a bool is not."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
            or int(value) < low or (high is not None and int(value) > high)):
        raise ValueError(f"{rule}, not {shown(value)}")
    return int(value)


class MatchSessions:
    """Per-clone session tokens and match secrets (see the module docstring).

    ``name``: shown in hook names (``rehydrate.secret:sessions:<name>``) and status.
    ``nbytes``: size of the kernel-drawn key, 16 to :data:`MAX_KEY_BYTES` (1024).
    ``engine``: default, the process-wide one.
    """

    def __init__(self, name: str = "match", *, nbytes: int = 32,
                 engine: Engine | None = None) -> None:
        nbytes = _whole(nbytes, 16, MAX_KEY_BYTES,
                        f"nbytes must be a whole number of bytes from 16 to {MAX_KEY_BYTES}")
        self.name = name
        def draw() -> bytearray:
            # Straight from the kernel into a buffer the Secret wipes after copying it:
            # no immutable copy of the key is left behind for a snapshot image.
            buf = bytearray(nbytes)
            urandom_into(buf)
            return buf

        self._secret = Secret.from_callable(draw, name=f"sessions:{name}", on_wiped="raise",
                                            engine=engine)

    @property
    def epoch(self) -> int:
        """How many keys this process has drawn (+1 per restore or resume)."""
        return self._secret.loads

    @property
    def available(self) -> bool:
        """False while wiped for a snapshot (tokens can be neither issued nor checked)."""
        return self._secret.available

    def _mac(self, label: bytes, message: str) -> bytes:
        with self._secret as key:
            mac = hmac.HMAC(key, hashes.SHA256())
        mac.update(label + b"\0" + _utf8(message))
        return mac.finalize()

    def token(self, subject: str) -> str:
        """The session token of ``subject`` (a player or connection id) in this clone."""
        if not isinstance(subject, str):
            raise TypeError(f"subject must be a str (a player or connection id), not "
                            f"{type(subject).__name__}")
        tag = self._mac(b"token", subject)[:_TOKEN_BYTES]
        return base64.urlsafe_b64encode(tag).decode()

    def verify(self, subject: str, token: str) -> bool:
        """True when ``token`` is ``subject``'s token in this clone (constant time)."""
        try:
            expected = self.token(subject).encode()
        except SecretUnavailable:
            return False
        # A token is whatever a client sent: anything but this clone's token is False.
        return constant_time.bytes_eq(expected, _utf8(token)) if isinstance(
            token, str) else False

    def derive(self, purpose: str, length: int = 32) -> bytes:
        """A secret for ``purpose`` (HKDF-SHA256 of this clone's key): e.g. a match's
        encryption key. Differs in every clone and after every restore. ``length``: 16 to
        8160 bytes (HKDF-SHA256's limit)."""
        if not isinstance(purpose, str):
            raise TypeError(f"purpose must be a str, not {type(purpose).__name__}")
        length = _whole(length, 16, 8160, "length must be a whole number of bytes from 16 to "
                                          "8160")
        with self._secret as key:
            hkdf = HKDF(algorithm=hashes.SHA256(), length=length, salt=None,
                        info=b"rehydrate.sessions\0" + _utf8(purpose))
            return hkdf.derive(key)

    def close(self) -> None:
        """Wipe the key and remove its hooks."""
        self._secret.close()
