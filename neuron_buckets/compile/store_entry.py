"""One graph store entry's record: which graph it is, its sha256, and what made it.

The record is the entry's commit point. It is written whole, and only once its graph object is
complete, so a reader that finds a record finds a finished graph, or a damaged one that the
sha256 exposes. It also carries what ``nb cache ls`` shows (size, age, the toolchain that made
the graph) and what ``nb compile --dry-run`` estimates from (compile seconds per piece).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

SHA_IN_NAME = 16  # hex digits of the sha256 in a graph object's name: enough to keep writers apart


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

    @staticmethod
    def record_name(key: str, ext: str) -> str:
        return f"{key}.{ext}.json"

    @property
    def graph_name(self) -> str:
        """Named by its content too: two machines that compile one key at once write two objects,
        never one object twice, so whichever record wins points at bytes nobody overwrites."""
        return f"{self.key}.{self.sha256[:SHA_IN_NAME]}.{self.ext}"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

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
