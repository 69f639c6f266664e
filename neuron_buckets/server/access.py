"""Who may call the server: an API key on ``/v1/*`` and, on a loopback bind, the Host header.

The key is vLLM's ``--api-key``: OpenAI clients send it as ``Authorization: Bearer KEY``, and a
missing or wrong one gets a 401. It is compared in constant time, so response timing does not
leak how much of a guess was right. An empty key would turn the check off and a key of other
characters than printable ASCII could never arrive intact in a header, so both are refused at
start. With a key, the API's description (``/openapi.json``, ``/docs``, ``/redoc``) needs it
too. ``/health`` is always open (a load balancer's probe has no key). ``/metrics`` is open unless
``key_metrics``: it holds counts and latencies, never text or token ids, Prometheus scrapers are
usually set up without credentials, and vLLM leaves it open too; a deployment that counts its
traffic as secret keys it.

A server on a loopback address is reachable from any web page the user opens, through DNS
rebinding: the page's own name resolves to 127.0.0.1, and the browser sends the page's name as
the Host. So a loopback server answers only requests whose Host is a loopback name or one of
``allowed_hosts``; anything else gets a 400. A server bound elsewhere checks the Host only
against ``allowed_hosts`` when some are given (its clients may use any name of the machine).

The checks are coroutines, though they never wait: FastAPI runs a plain function dependency on a
worker thread, a thread hop per request that takes the GIL from the engine thread once more.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass

from starlette.exceptions import HTTPException
from starlette.requests import Request

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server to this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The Host header without its port: ``127.0.0.1:8000`` -> ``127.0.0.1``, ``[::1]:80`` -> ``[::1]``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[: header.find("]") + 1]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


@dataclass(frozen=True)
class ServerAccess:
    api_key: str | None = None
    key_metrics: bool = False  # /metrics needs the key too
    allowed_hosts: frozenset[str] | None = LOOPBACK_NAMES  # None: any Host

    def __post_init__(self) -> None:
        if self.api_key is None:
            return
        if not self.api_key:
            raise ValueError("the API key is empty: give one, or unset NB_API_KEY to serve without a key")
        if not all("!" <= c <= "~" for c in self.api_key):
            raise ValueError("the API key must be printable ASCII without spaces, as an Authorization "
                             "header carries it")

    @classmethod
    def for_bind(
        cls, host: str, api_key: str | None, key_metrics: bool, extra_hosts: tuple[str, ...]
    ) -> ServerAccess:
        """Loopback binds check the Host against the loopback names and ``extra_hosts``; other
        binds only against ``extra_hosts``, when given."""
        extra = frozenset(h.lower() for h in extra_hosts)
        hosts = LOOPBACK_NAMES | extra if is_loopback(host) else (extra or None)
        return cls(api_key, key_metrics, hosts)

    async def check_host(self, request: Request) -> None:
        header = request.headers.get("host")
        if self.allowed_hosts is None or header is None:  # HTTP/1.0 sends none; browsers always do
            return
        if host_name(header) not in self.allowed_hosts:
            raise HTTPException(400, f"Host {header!r} is not served here; start nb serve with "
                                     f"--allowed-host to add a name")

    async def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode("utf-8", "surrogateescape"), self.api_key.encode()
        )
        if not ok:
            raise HTTPException(401, "a valid API key is needed: send it as 'Authorization: Bearer KEY'")

    async def check_metrics(self, request: Request) -> None:
        if self.key_metrics:
            await self.check_key(request)
