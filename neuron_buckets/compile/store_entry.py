"""One graph store entry's record: which graph it is, its sha256, and what made it.

The record is the entry's commit point. It is written whole, and only once its graph object is
complete, so a reader that finds a record finds a finished graph, or a damaged one that the
sha256 exposes. It also carries what ``nb cache ls`` shows (size, age, the toolchain that made
the graph) and what ``nb compile --dry-run`` estimates from (compile seconds per piece).

Signing (opt-in): with ``NB_STORE_SIGNING_KEY`` set, every record published carries an HMAC-SHA256
of its fields (the graph's sha256 among them) under that secret, and every record read must carry
a valid one. Keys are predictable and the first record wins, so without it anyone who can write
a shared store can publish native code under a key not built yet; with it, only holders of the
secret can, and an unsigned or forged record counts as damaged: it is discarded and compiled
again (so a squatted key is freed, not blocked).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import asdict, dataclass, field, replace

SHA_IN_NAME = 16  # hex digits of the sha256 in a graph object's name: enough to keep writers apart
SIGNING_KEY_ENV = "NB_STORE_SIGNING_KEY"


def signing_key() -> bytes | None:
    """The secret records are signed and checked with, if this machine has one."""
    return os.environ.get(SIGNING_KEY_ENV, "").encode() or None


@dataclass(frozen=True)
class StoreEntry:
    key: str
    ext: str
    sha256: str
    bytes: int
    compile_seconds: float
    piece: str  # the piece's name, e.g. layer_t16_b1_c128
    backend: str
    versions: dict[str, str] = field(default_factory=dict)  # the backend's, as hashed into the key
    toolchain: str = ""  # the neuron-buckets version that compiled it
    created: float = 0.0  # unix time of the compile
    signature: str = ""  # HMAC-SHA256 of the other fields under NB_STORE_SIGNING_KEY ("" unsigned)

    @staticmethod
    def record_name(key: str, ext: str) -> str:
        return f"{key}.{ext}.json"

    @property
    def graph_name(self) -> str:
        """Named by its content too: two machines that compile one key at once write two objects,
        never one object twice, so whichever record wins points at bytes nobody overwrites."""
        return f"{self.key}.{self.sha256[:SHA_IN_NAME]}.{self.ext}"

    def to_json(self) -> bytes:
        """The record; an unsigned one without the field, as older nb versions read it."""
        d = asdict(self)
        if not d["signature"]:
            del d["signature"]
        return json.dumps(d, sort_keys=True).encode()

    def _mac(self, key: bytes) -> str:
        return hmac.new(key, replace(self, signature="").to_json(), hashlib.sha256).hexdigest()

    def signed(self, key: bytes | None) -> StoreEntry:
        """This record signed with ``key`` (unchanged without one)."""
        return replace(self, signature=self._mac(key)) if key else self

    def check_signature(self, key: bytes | None) -> StoreEntry:
        """This record if ``key`` is None or signed it; else a ValueError (a damaged record)."""
        if key and not hmac.compare_digest(self.signature, self._mac(key)):
            why = "unsigned" if not self.signature else "its signature does not match"
            raise ValueError(f"{why}: not published with this machine's {SIGNING_KEY_ENV}")
        return self

    @classmethod
    def from_json(cls, data: bytes) -> StoreEntry:
        """Parse a record; anything that is not a whole one (truncated, edited) is a ValueError."""
        try:
            raw = json.loads(data)
            entry = cls(**raw)
        except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"not a graph store record: {e}") from None
        if not (isinstance(entry.sha256, str) and len(entry.sha256) == 64 and isinstance(entry.bytes, int)):
            raise ValueError("not a graph store record: no sha256 or size")
        return entry
