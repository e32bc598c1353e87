"""Who may connect to a coordinator, and as what: CurveZMQ keys and the coordinator's ZAP handler.

Every socket is encrypted and authenticated with CurveZMQ. A key directory (``plexrl keys``)
holds the coordinator's key pair and one allowlist per role, each a folder of public keys::

    DIR/coordinator.key          the coordinator's public key (give it to every peer)
    DIR/coordinator.key_secret   its secret key (mode 0600; stays with the coordinator)
    DIR/workers/NAME.key         public keys allowed to register workers
    DIR/clients/NAME.key         public keys allowed to open jobs (tenants)
    DIR/admins/NAME.key          clients that also see every tenant's jobs
    DIR/secret/NAME.key_secret   the issued secret keys (mode 0600), to hand to their owners

The ZAP handler (pyzmq's authenticator on a thread) admits a connection whose key is on any
allowlist and sets the connection's ``User-Id`` to the key (z85); the coordinator reads it on every
message and checks the role: a client key cannot register a worker, a worker key cannot open a job.
A key added with ``plexrl keys add`` counts from the next connection (an unknown key makes the
handler read the allowlists again if a folder changed since); a removed one until a restart.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from plexrl.errors import InvalidRequestError

ROLES = ("worker", "client", "admin")
FOLDERS = {"worker": "workers", "client": "clients", "admin": "admins"}
COORDINATOR = "coordinator"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class KeyPair:
    """A CurveZMQ key pair, z85-encoded (40 bytes each)."""

    public: bytes
    secret: bytes


def write_pair(secret_path: Path, public_path: Path) -> KeyPair:
    """Make a key pair: the secret file (mode 0600, created so) and the public one."""
    public, secret = zmq.curve_keypair()
    _write(secret_path, f'curve\n    public-key = "{public.decode()}"\n    secret-key = "{secret.decode()}"\n', 0o600)
    _write(public_path, f'curve\n    public-key = "{public.decode()}"\n', 0o644)
    return KeyPair(public, secret)


def load_pair(path: str | os.PathLike[str]) -> KeyPair:
    """The key pair in a ``.key_secret`` file; refuses one that others can read."""
    p = Path(path)
    if not p.is_file():
        raise InvalidRequestError(f"no key file at {p}: make one with `plexrl keys add DIR NAME --role ...`")
    if p.stat().st_mode & 0o077:
        raise InvalidRequestError(f"{p} is readable by others (mode {p.stat().st_mode & 0o777:o}): `chmod 600 {p}`")
    public, secret = zmq.auth.load_certificate(p)
    if secret is None:
        raise InvalidRequestError(f"{p} holds no secret key: pass the NAME.key_secret file, not NAME.key")
    return KeyPair(public, secret)


def load_public(path: str | os.PathLike[str]) -> bytes:
    """The public key in a ``.key`` (or ``.key_secret``) file."""
    p = Path(path)
    if not p.is_file():
        raise InvalidRequestError(f"no public key file at {p} (the coordinator's is DIR/coordinator.key)")
    return zmq.auth.load_certificate(p)[0]


def init_dir(directory: str | os.PathLike[str]) -> KeyPair:
    """A new key directory with the coordinator's pair and empty allowlists."""
    d = Path(directory)
    if (d / f"{COORDINATOR}.key_secret").exists():
        raise InvalidRequestError(f"{d} already holds a coordinator key; use `plexrl keys add {d} NAME` for more")
    for folder in (*FOLDERS.values(), "secret"):
        (d / folder).mkdir(parents=True, exist_ok=True)
    (d / "secret").chmod(0o700)
    return write_pair(d / f"{COORDINATOR}.key_secret", d / f"{COORDINATOR}.key")


def add_key(directory: str | os.PathLike[str], name: str, role: str) -> Path:
    """Issue a key for ``role`` (its public half on that role's allowlist); returns the secret file."""
    d = Path(directory)
    if role not in ROLES:
        raise InvalidRequestError(f"role {role!r}: choose one of {', '.join(ROLES)}")
    if not NAME.match(name):
        raise InvalidRequestError(f"key name {name!r}: letters, digits, '_', '.', '-' (up to 64), no path")
    if not (d / f"{COORDINATOR}.key").exists():
        raise InvalidRequestError(f"{d} is not a key directory: make one with `plexrl keys init {d}`")
    secret = d / "secret" / f"{name}.key_secret"
    if secret.exists():
        raise InvalidRequestError(f"a key named {name!r} exists already ({secret})")
    write_pair(secret, d / FOLDERS[role] / f"{name}.key")
    return secret


class Allowlist:
    """The public keys of each role in a key directory (read again by ``reload``)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.roles: dict[bytes, str] = {}
        self.names: dict[bytes, str] = {}  # key -> its file's name: the tenant plexrl status shows
        self._stamp: tuple[int, ...] = ()
        self.reload()

    def reload(self) -> None:
        roles: dict[bytes, str] = {}
        names: dict[bytes, str] = {}
        for role in ROLES:  # admin last: an admin key listed as a client too is an admin
            for path in sorted((self.directory / FOLDERS[role]).glob("*.key")):
                public = zmq.auth.load_certificate(path)[0]
                roles[public], names[public] = role, path.stem
        self.roles, self.names = roles, names  # replaced whole: the coordinator's thread reads them
        self._stamp = self._folders_stamp()

    def _folders_stamp(self) -> tuple[int, ...]:
        return tuple((self.directory / FOLDERS[role]).stat().st_mtime_ns for role in ROLES)

    def role(self, user_id: str | None) -> str | None:
        """The role of the connection whose ZAP ``User-Id`` is ``user_id``; None if it has none."""
        return None if user_id is None else self.roles.get(user_id.encode())

    def name(self, user_id: str) -> str:
        return self.names.get(user_id.encode(), user_id)

    def callback(self, domain: str, key: bytes) -> bool:  # pyzmq's credentials provider (its thread)
        if key not in self.roles and self._folders_stamp() != self._stamp:
            self.reload()  # a key issued since
        return key in self.roles


def start_authenticator(ctx: zmq.Context[zmq.Socket[bytes]], allowlist: Allowlist) -> ThreadAuthenticator:
    """The ZAP handler for ``ctx``'s sockets: admits keys on ``allowlist``; ``stop()`` it at the end."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=allowlist)
    return auth


def serve_curve(sock: zmq.Socket[bytes], pair: KeyPair) -> None:
    """Make ``sock`` (before it binds) a CurveZMQ server with ``pair``."""
    sock.curve_secretkey = pair.secret
    sock.curve_publickey = pair.public
    sock.curve_server = True


@dataclass(frozen=True)
class Credentials:
    """What a worker or client connects with: its own key pair and the coordinator's public key."""

    pair: KeyPair
    coordinator: bytes

    @staticmethod
    def load(key: str | os.PathLike[str], coordinator_key: str | os.PathLike[str]) -> Credentials:
        return Credentials(load_pair(key), load_public(coordinator_key))

    @staticmethod
    def from_env() -> Credentials | None:
        """``$PLEXRL_KEY`` (a ``.key_secret`` file) and ``$PLEXRL_COORDINATOR_KEY``; None if unset."""
        key, coordinator = os.environ.get("PLEXRL_KEY"), os.environ.get("PLEXRL_COORDINATOR_KEY")
        if not key and not coordinator:
            return None
        if not key or not coordinator:
            raise InvalidRequestError("set both PLEXRL_KEY (your .key_secret file) and PLEXRL_COORDINATOR_KEY")
        return Credentials.load(key, coordinator)

    def apply(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` (before it connects) a CurveZMQ client with these credentials."""
        sock.curve_secretkey = self.pair.secret
        sock.curve_publickey = self.pair.public
        sock.curve_serverkey = self.coordinator


def check_insecure_bind(address: str) -> None:
    """Unauthenticated mode only on a loopback address (anyone who can reach it can use it)."""
    host = re.sub(r"^tcp://|:[^:]*$", "", address).strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if address.startswith(("ipc://", "inproc://")):
        loopback = True
    if not loopback:
        raise InvalidRequestError(
            f"refusing to serve {address} without authentication: bind a loopback address (tcp://127.0.0.1:PORT), "
            "or pass --keys DIR (make one with `plexrl keys init DIR`)"
        )


def _write(path: Path, text: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write("#   ZeroMQ CURVE certificate (plexrl keys)\n" + text)
