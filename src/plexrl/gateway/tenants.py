"""Which plexrl tenant a Tinker API key's jobs belong to: one plexrl client (key) per API key.

A plexrl tenant is a client key (``plexrl keys add DIR NAME --role client``): the coordinator
keeps each tenant's jobs apart, applies its quotas (``--max-calls-per-tenant``, ...) and shows it
in ``plexrl status``. Three ways to map API keys onto tenants:

- ``SharedTenant``: every API key's jobs are the gateway's own key's (``plexrl tinker`` without
  ``--tenants``); API keys are kept apart by the gateway alone.
- ``KeyedTenants.from_file``: a JSON map ``{"tml-alice": "alice.key_secret", ...}``; an API key
  not in it is refused (HTTP 401).
- ``KeyedTenants.issued``: on an embedded cluster (``plexrl tinker --local``), a client key is
  issued for each API key when it first connects.

The gateway connects a tenant's plexrl client on the API key's first job and closes it at the end.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from plexrl.client.connection import Client
from plexrl.errors import InvalidRequestError
from plexrl.protocol import auth


class Tenants(Protocol):
    def admits(self, api_key: str) -> bool: ...
    async def client(self, api_key: str) -> Client: ...
    async def close(self) -> None: ...


class SharedTenant:
    """Every API key on one plexrl client, which its owner closes."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def admits(self, api_key: str) -> bool:
        return True

    async def client(self, api_key: str) -> Client:
        return self._client

    async def close(self) -> None:
        pass


class KeyedTenants:
    """A plexrl client per API key, with the credentials ``credentials_of`` gives it (None: refused)."""

    def __init__(self, coordinator: str, credentials_of: Callable[[str], auth.Credentials | None]) -> None:
        self.coordinator = coordinator
        self._credentials_of = credentials_of
        self._credentials: dict[str, auth.Credentials | None] = {}
        self._clients: dict[str, asyncio.Future[Client]] = {}

    @staticmethod
    def from_file(coordinator: str, path: str | Path, coordinator_public: bytes) -> KeyedTenants:
        """API keys mapped to client key files by the JSON object in ``path`` (relative file names
        are read beside it)."""
        p = Path(path)
        try:
            mapping = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise InvalidRequestError(f"--tenants {p}: not a readable JSON file ({e})") from None
        if not isinstance(mapping, dict) or not all(
            isinstance(k, str) and k.startswith("tml-") and isinstance(v, str) for k, v in mapping.items()
        ):
            raise InvalidRequestError(
                f'--tenants {p}: give a JSON object of API keys to client key files, {{"tml-alice": "alice.key_secret"}}'
            )
        credentials = {
            k: auth.Credentials(auth.load_pair(p.parent / v), coordinator_public) for k, v in mapping.items()
        }
        return KeyedTenants(coordinator, credentials.get)

    @staticmethod
    def issued(coordinator: str, keys: Path) -> KeyedTenants:
        """A client key issued in key directory ``keys`` for each API key, named by its hash (an
        API key is a secret: it names no file)."""

        def credentials_of(api_key: str) -> auth.Credentials:
            name = "tinker-" + hashlib.sha256(api_key.encode()).hexdigest()[:16]
            secret = keys / "secret" / f"{name}.key_secret"
            if not secret.exists():
                auth.add_key(keys, name, "client")
            return auth.Credentials.load(secret, keys / f"{auth.COORDINATOR}.key")

        return KeyedTenants(coordinator, credentials_of)

    def admits(self, api_key: str) -> bool:
        return self._credentials_for(api_key) is not None

    def _credentials_for(self, api_key: str) -> auth.Credentials | None:
        if api_key not in self._credentials:
            self._credentials[api_key] = self._credentials_of(api_key)
        return self._credentials[api_key]

    async def client(self, api_key: str) -> Client:
        if api_key not in self._clients:
            self._clients[api_key] = asyncio.ensure_future(self._connect(api_key))
        try:
            return await asyncio.shield(self._clients[api_key])
        except Exception:
            self._clients.pop(api_key, None)  # the next job tries again
            raise

    async def _connect(self, api_key: str) -> Client:
        credentials = self._credentials_for(api_key)
        if credentials is None:
            raise InvalidRequestError("this API key is not in the gateway's --tenants map")
        client = Client(self.coordinator, credentials=credentials)
        await client.open()
        return client

    async def close(self) -> None:
        for connecting in self._clients.values():
            if connecting.done() and not connecting.cancelled() and connecting.exception() is None:
                await connecting.result().close()
            else:
                connecting.cancel()
        self._clients.clear()
