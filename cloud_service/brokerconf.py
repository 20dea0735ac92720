"""Broker security: a Mosquitto configuration, its password file, per-agent ACLs, a dev CA.

``cloud-service broker-config --out DIR`` writes:

- ``mosquitto.conf``: ``per_listener_settings true`` and two kinds of listener, each
  with ``allow_anonymous false`` and its own password and ACL files. The agents' TLS
  listener (``require_certificate false``: clients prove who they are with a
  password) knows only agent users and sets ``use_username_as_clientid true``: an
  agent's client id is always its user name ``{fleet}.{agent}``, which holds a dot
  and so never equals a service's id (service ids never contain one); an agent can
  take over no session but its own. The services' TLS listener (and optionally a
  loopback plaintext one for processes on the broker's host) knows only the service
  users, so agent credentials authenticate nowhere else. Global limits:
  ``max_packet_size`` (the largest sample envelope plus a margin; a larger packet
  drops the connection), ``max_queued_messages`` and ``max_queued_bytes`` per
  client; ``set_tcp_nodelay true``, persistence and a pid file.
- ``passwd`` (agents) and ``service-passwd`` (services): Mosquitto's format,
  ``user:$7$<iterations>$<salt b64>$<pbkdf2-sha512 b64>`` (what ``mosquitto_passwd``
  2.x writes; generated here in Python).
- ``acl`` and ``service-acl``: derived from the password files, never edited by hand.
  An agent's user name is ``{fleet}.{agent}`` (ids never contain a dot, so the split
  is exact); it may publish only its own samples, status and model-status, and read
  only its own receipts, verdicts and announcements and its fleet's announcement, so
  receipts, verdicts and announcements come only from the services. Service users
  (``edgeloop-verifier``, ``edgeloop-api``) get the whole topic prefix.
- ``ca.crt``/``ca.key``, ``server.crt``/``server.key``: a development CA and a server
  certificate for 127.0.0.1 and localhost (``--dev-ca``; production brings its own).
- ``verifier.env`` and ``api.env`` (mode 0600): the service users' credentials as
  ``EDGELOOP_MQTT_USERNAME``/``EDGELOOP_MQTT_PASSWORD`` lines.

Enrollment with ``broker_auth`` on adds the agent's user (``add_agent``): the files are
rewritten atomically under a lock, then Mosquitto is asked to reload them with SIGHUP
to the pid in ``broker_pid_file`` (Mosquitto 2 rereads password and ACL files on
SIGHUP; connected clients keep their session). Without a pid file the operator
reloads the broker.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import fcntl
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ConfigError
from shared.topics import Topics, validate_id

__all__ = [
    "PACKET_MARGIN_BYTES",
    "SERVICE_USERS",
    "BrokerFiles",
    "add_agent",
    "agent_files",
    "agent_username",
    "check_password",
    "generate_dev_ca",
    "hash_password",
    "max_packet_size",
    "render_acl",
    "render_mosquitto_conf",
    "service_files",
    "write_broker_config",
]

log = logging.getLogger(__name__)

SERVICE_USERS = ("edgeloop-verifier", "edgeloop-api")
PBKDF2_ITERATIONS = 101  # mosquitto_passwd 2.0's default; the count travels in the hash
_SALT_BYTES = 12
# Room in one MQTT packet beyond the envelope's header and image: the envelope's
# fixed prefix, the fixed header, the topic and the v5 properties.
PACKET_MARGIN_BYTES = 8192


def max_packet_size(max_header_bytes: int, max_image_bytes: int) -> int:
    """The broker's packet limit: the largest sample envelope the cloud accepts, plus a margin."""
    return max_header_bytes + max_image_bytes + PACKET_MARGIN_BYTES


def agent_username(fleet: str, agent: str) -> str:
    """The broker user of one agent: ``{fleet}.{agent}`` (ids cannot contain a dot)."""
    return f"{validate_id(fleet, 'fleet')}.{validate_id(agent, 'agent')}"


def hash_password(password: str, *, iterations: int = PBKDF2_ITERATIONS) -> str:
    """Mosquitto 2's PBKDF2-SHA512 form: ``$7$<iterations>$<salt b64>$<hash b64>``."""
    salt = secrets.token_bytes(_SALT_BYTES)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def check_password(password: str, hashed: str) -> bool:
    """Whether ``password`` matches a ``$7$`` hash (for tests and diagnostics)."""
    try:
        _, kind, iterations, salt, digest = hashed.split("$")
        if kind != "7":
            return False
        mine = hashlib.pbkdf2_hmac(
            "sha512", password.encode(), base64.b64decode(salt), int(iterations)
        )
    except ValueError:
        return False
    return hmac.compare_digest(mine, base64.b64decode(digest))


def render_acl(users: list[str], topics: Topics, *, services: bool = False) -> str:
    """An ACL file: for the services' listener the prefix, else each agent its own topics."""
    prefix = topics.prefix
    lines = ["# Generated by cloud-service from the password file; do not edit.", ""]
    for user in users:
        if services:
            if "." not in user:  # a dotted name is an agent's: no rights here
                lines += [f"user {user}", f"topic readwrite {prefix}/#", ""]
            continue
        fleet, _, agent = user.partition(".")
        if not agent:
            continue  # not an agent name: no rights at all
        lines += [
            f"user {user}",
            f"topic write {topics.samples(fleet, agent)}",
            f"topic readwrite {topics.status(fleet, agent)}",
            f"topic write {topics.model_status(fleet, agent)}",
            f"topic read {topics.receipts(fleet, agent)}",
            f"topic read {topics.verdicts(fleet, agent)}",
            f"topic read {topics.agent_models(fleet, agent)}",
            f"topic read {topics.fleet_models(fleet)}",
            "",
        ]
    return "\n".join(lines)


@dataclass(frozen=True)
class BrokerFiles:
    """Where one listener kind's security files live (``services``: the services' ones)."""

    password_file: Path
    acl_file: Path
    pid_file: Path | None = None
    services: bool = False

    @property
    def lock_file(self) -> Path:
        return self.password_file.with_name(self.password_file.name + ".lock")


def agent_files(folder: Path) -> BrokerFiles:
    """The agents' password and ACL files in a broker-config folder (what enrollment writes)."""
    return BrokerFiles(folder / "passwd", folder / "acl", folder / "mosquitto.pid")


def service_files(folder: Path) -> BrokerFiles:
    """The services' password and ACL files in a broker-config folder."""
    return BrokerFiles(
        folder / "service-passwd", folder / "service-acl", folder / "mosquitto.pid", services=True
    )


def _atomic_write(path: Path, text: str, mode: int = 0o600) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(files: BrokerFiles) -> Iterator[None]:
    """Serialise writers (API replicas on one host) with an exclusive flock."""
    files.lock_file.parent.mkdir(parents=True, exist_ok=True)
    with files.lock_file.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read_users(path: Path) -> dict[str, str]:
    users: dict[str, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            name, sep, hashed = line.partition(":")
            if sep and name and not line.startswith("#"):
                users[name] = hashed
    return users


def _write_users(files: BrokerFiles, users: dict[str, str], topics: Topics) -> None:
    _atomic_write(files.password_file, "".join(f"{u}:{h}\n" for u, h in users.items()))
    _atomic_write(files.acl_file, render_acl(list(users), topics, services=files.services))


def set_password(files: BrokerFiles, username: str, password: str, topics: Topics) -> None:
    """Add or replace one user in the password file and rebuild the ACL."""
    if ":" in username or "\n" in username:
        raise ConfigError(f"broker user name {username!r} may not contain ':' or a newline")
    # Agent names hold a dot, service names never: each file only ever holds its own kind.
    if files.services == ("." in username):
        kind = "service" if files.services else "agent"
        raise ConfigError(f"broker user {username!r} does not belong in the {kind} password file")
    with _locked(files):
        users = _read_users(files.password_file)
        users[username] = hash_password(password)
        _write_users(files, users, topics)


def reload_broker(files: BrokerFiles) -> bool:
    """SIGHUP the broker named by the pid file; False when there is none to signal."""
    if files.pid_file is None or not files.pid_file.exists():
        return False
    try:
        pid = int(files.pid_file.read_text().strip())
        os.kill(pid, signal.SIGHUP)
    except (ValueError, ProcessLookupError, PermissionError) as exc:
        log.warning("could not ask the broker to reload (%s): reload it by hand", exc)
        return False
    return True


def add_agent(files: BrokerFiles, fleet: str, agent: str, topics: Topics) -> tuple[str, str]:
    """New broker credentials for one agent (a re-enrollment replaces the old password)."""
    username = agent_username(fleet, agent)
    password = secrets.token_urlsafe(24)
    set_password(files, username, password, topics)
    reload_broker(files)
    log.info("broker credentials issued for %s", username)  # the name only, never the password
    return username, password


# --- certificates -------------------------------------------------------------


def generate_dev_ca(out: Path, *, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> None:
    """A development CA and a server certificate for ``hosts`` (valid 1 year)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "EdgeLoop development CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=365))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    key_args = (pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / "ca.key", ca_key.private_bytes(*key_args).decode())
    _atomic_write(out / "ca.crt", ca_cert.public_bytes(pem).decode(), 0o644)
    _atomic_write(out / "server.key", server_key.private_bytes(*key_args).decode())
    _atomic_write(out / "server.crt", server_cert.public_bytes(pem).decode(), 0o644)


def render_mosquitto_conf(
    out: Path,
    *,
    tls_port: int = 8883,
    host: str = "0.0.0.0",
    service_port: int | None = 8884,
    plain_port: int | None = None,
    max_queued_messages: int = 100_000,
    max_queued_bytes: int = 512 * 1024 * 1024,
    packet_limit: int = max_packet_size(4096, 2_000_000),
    run_as_root: bool = False,
) -> str:
    """Mosquitto 2 configuration over the files in ``out``."""
    agents, services = agent_files(out), service_files(out)
    tls = [
        f"cafile {out / 'ca.crt'}",
        f"certfile {out / 'server.crt'}",
        f"keyfile {out / 'server.key'}",
        "require_certificate false",
        "tls_version tlsv1.2",
    ]

    def auth(files: BrokerFiles) -> list[str]:
        return [
            "allow_anonymous false",
            f"password_file {files.password_file}",
            f"acl_file {files.acl_file}",
        ]

    lines = [
        "# Generated by `cloud-service broker-config`.",
        # Each listener its own users: agent credentials authenticate only on the agents'.
        "per_listener_settings true",
        # Nagle holds back small PUBACKs and QoS 1 throughput collapses (docs/architecture.md).
        "set_tcp_nodelay true",
        # Larger than any sample envelope the cloud accepts: a bigger packet drops the client.
        f"max_packet_size {packet_limit}",
        # A slow verifier's queue must not overflow (Mosquitto drops QoS 1 beyond it),
        # nor may queued payloads grow without bound (agents' spools republish the rest).
        f"max_queued_messages {max_queued_messages}",
        f"max_queued_bytes {max_queued_bytes}",
        "max_inflight_messages 200",
        "persistence true",
        f"persistence_location {out}/",
        "autosave_interval 30",
        f"pid_file {out / 'mosquitto.pid'}",
        f"log_dest file {out / 'mosquitto.log'}",
        "log_type error",
        "log_type warning",
        "log_type notice",
        "",
        "# Agents: TLS, agent users only, client id = user name ({fleet}.{agent}).",
        f"listener {tls_port} {host}",
        *auth(agents),
        "use_username_as_clientid true",
        *tls,
    ]
    if service_port is not None:
        lines += ["", "# Services: TLS, service users only.", f"listener {service_port} {host}"]
        lines += [*auth(services), *tls]
    if plain_port is not None:
        # Plaintext only on loopback, for the services on this host.
        lines += ["", "# Services on this host: plaintext on loopback, service users only."]
        lines += [f"listener {plain_port} 127.0.0.1", *auth(services)]
    if run_as_root:
        lines.insert(1, "user root")
    return "\n".join(lines) + "\n"


def write_broker_config(
    out: Path,
    *,
    topics: Topics,
    tls_port: int = 8883,
    host: str = "0.0.0.0",
    service_port: int | None = 8884,
    plain_port: int | None = None,
    dev_ca: bool = False,
    max_queued_messages: int = 100_000,
    max_queued_bytes: int = 512 * 1024 * 1024,
    packet_limit: int = max_packet_size(4096, 2_000_000),
    service_passwords: dict[str, str] | None = None,
) -> BrokerFiles:
    """Write the whole broker configuration into ``out``; return the agents' files."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if dev_ca:
        generate_dev_ca(out)
    elif not (out / "server.crt").exists():
        raise ConfigError(
            f"{out} has no server.crt/server.key/ca.crt: pass --dev-ca for a development CA "
            "or put your own certificates there"
        )
    if service_port is None and plain_port is None:
        raise ConfigError("the services need a listener: give a service port or a plain port")
    files, services = agent_files(out), service_files(out)
    with _locked(files):  # an agent file (empty until the first enrollment) and its ACL
        users = _read_users(files.password_file)
        _write_users(files, {u: h for u, h in users.items() if "." in u}, topics)
    passwords = dict(service_passwords or {})
    for user in SERVICE_USERS:
        password = passwords.setdefault(user, secrets.token_urlsafe(24))
        set_password(services, user, password, topics)
        env_name = user.removeprefix("edgeloop-")
        _atomic_write(
            out / f"{env_name}.env",
            f"EDGELOOP_MQTT_USERNAME={user}\nEDGELOOP_MQTT_PASSWORD={password}\n"
            f"EDGELOOP_MQTT_CA_FILE={out / 'ca.crt'}\n",
        )
    conf = render_mosquitto_conf(
        out,
        tls_port=tls_port,
        host=host,
        service_port=service_port,
        plain_port=plain_port,
        max_queued_messages=max_queued_messages,
        max_queued_bytes=max_queued_bytes,
        packet_limit=packet_limit,
        run_as_root=os.geteuid() == 0,
    )
    _atomic_write(out / "mosquitto.conf", conf, 0o644)
    return files
