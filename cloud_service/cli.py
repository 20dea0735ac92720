"""``cloud-service``: the command line of the cloud processes."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any

import typer

from cloud_service.settings import CloudSettings
from shared.broker import EmbeddedBroker
from shared.console import (
    ConfigOption,
    JsonOption,
    add_settings_command,
    console,
    fail,
    load_settings,
    print_json,
)
from shared.errors import EdgeLoopError
from shared.manifest import FleetSigningKey

app = typer.Typer(help="EdgeLoop cloud service: ingest, verifier, API.", no_args_is_help=True)
add_settings_command(app, CloudSettings)
keys_app = typer.Typer(help="The fleet's model-signing key.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
tokens_app = typer.Typer(help="One-time agent enrollment tokens.", no_args_is_help=True)
app.add_typer(tokens_app, name="tokens")
users_app = typer.Typer(help="Users of the review UI (admin, reviewer).", no_args_is_help=True)
app.add_typer(users_app, name="users")

log = logging.getLogger(__name__)
HostOption = typer.Option(None, "--host", help="Address to listen on (settings: http_host).")


def _quiet_migrations() -> None:
    """Alembic's INFO lines (plugins set up, the DDL mode) say nothing an operator needs."""
    logging.getLogger("alembic").setLevel(logging.WARNING)


def _migrate(url: str) -> None:
    """Bring the schema up to date, quietly (a command's output is its answer)."""
    from cloud_service.db.session import upgrade_database

    _quiet_migrations()
    upgrade_database(url)


def _serve(
    which: str,
    config: Path | None,
    host: str | None,
    port: int | None,
    workers: int | None = None,
    **overrides: object,
) -> None:
    from cloud_service import service

    if host is not None:  # through the settings, so the production checks see the address
        overrides["http_host"] = host
    settings = load_settings(CloudSettings, config, **overrides)
    _quiet_migrations()
    _warn_if_anonymous_broker(settings)
    default_port = settings.http_port + (1 if which == "verifier" else 0)
    host, port = settings.http_host, default_port if port is None else port
    try:
        if which == "verifier":
            count = settings.verifier_workers if workers is None else workers
            service.run_verifiers(settings, host=host, port=port, workers=count)
        else:
            {"api": service.run_api, "all": service.run_all}[which](settings, host=host, port=port)
    except EdgeLoopError as exc:
        fail(exc.message)


def _warn_if_anonymous_broker(settings: CloudSettings) -> None:
    """Say loudly that a broker without per-agent identities is for development only."""
    if not settings.broker_auth:
        log.warning(
            "BROKER IS ANONYMOUS (development only): broker_auth is off, so enrolled agents "
            "get no broker credentials and any client that reaches the broker may read and "
            "forge samples, receipts and verdicts; set EDGELOOP_BROKER_AUTH=true with "
            "`cloud-service broker-config` for per-agent identities"
        )


@app.command("api")
def api_command(
    config: Path | None = ConfigOption,
    host: str | None = HostOption,
    port: int | None = typer.Option(None, "--port", help="Port (settings: http_port)."),
) -> None:
    """Run the REST API (enrollment, samples, verdicts, labels, stats, KServe V2)."""
    _serve("api", config, host, port)


@app.command("verifier")
def verifier_command(
    config: Path | None = ConfigOption,
    host: str | None = HostOption,
    port: int | None = typer.Option(
        None,
        "--port",
        help="Port of /healthz, /readyz, /metrics (settings: http_port + 1); worker i: port + i.",
    ),
    workers: int | None = typer.Option(
        None,
        "--workers",
        min=1,
        max=64,
        help="Verifier processes on this host, splitting the samples through the broker's"
        " MQTT v5 shared subscription (settings: verifier_workers).",
    ),
) -> None:
    """Run MQTT ingest and the teacher with dynamic batching."""
    _serve("verifier", config, host, port, workers)


@app.command("all")
def all_command(
    config: Path | None = ConfigOption,
    host: str | None = HostOption,
    port: int | None = typer.Option(None, "--port", help="Port (settings: http_port)."),
    worker: bool | None = typer.Option(
        None,
        "--worker/--no-worker",
        help="Run a distill worker process beside them (settings: distill_worker, on).",
    ),
) -> None:
    """Run the API, review UI and verifier in one process, and a distill worker beside it."""
    overrides = {} if worker is None else {"distill_worker": worker}
    _serve("all", config, host, port, **overrides)


@tokens_app.command("create")
def create_token_command(
    fleet: str = typer.Option(..., "--fleet", help="Fleet the agent joins."),
    agent: str | None = typer.Option(None, "--agent", help="Agent id the token is bound to."),
    ttl_s: int | None = typer.Option(None, "--ttl", help="Seconds the token is valid."),
    config: Path | None = ConfigOption,
    as_json: bool = JsonOption,
) -> None:
    """Create a one-time enrollment token (printed once; only its hash is stored)."""
    from cloud_service.db import crud
    from cloud_service.db.session import make_engine, make_session_factory
    from shared.topics import validate_id

    settings = load_settings(CloudSettings, config)
    try:
        validate_id(fleet, "fleet")
        if agent is not None:
            validate_id(agent, "agent")
        url = settings.resolved_database_url
        _migrate(url)
        engine = make_engine(url)
        with make_session_factory(engine).begin() as session:
            token, expires_at = crud.create_enrollment_token(
                session=session,
                fleet=fleet,
                agent_id=agent,
                ttl_s=ttl_s or settings.enrollment_ttl_s,
            )
        engine.dispose()
    except EdgeLoopError as exc:
        fail(exc.message)
    result = {"token": token, "expires_at": expires_at.isoformat(), "fleet": fleet, "agent": agent}
    if as_json:
        print_json(result)
        return
    console.print(f"enrollment token (shown once): [bold]{token}[/]")
    console.print(f"fleet {fleet}, agent {agent or '(agent chooses)'}, expires {expires_at}")


def _password(password: str | None) -> str:
    """The password from --password, else asked twice on the terminal (never echoed)."""
    if password:
        return password
    return str(typer.prompt("password", hide_input=True, confirmation_prompt=True))


def _with_session(config: Path | None, work):  # type: ignore[no-untyped-def]
    from cloud_service.db.session import make_engine, make_session_factory

    settings = load_settings(CloudSettings, config)
    try:
        url = settings.resolved_database_url
        _migrate(url)
        engine = make_engine(url)
        try:
            with make_session_factory(engine).begin() as session:
                return work(session)
        finally:
            engine.dispose()
    except EdgeLoopError as exc:
        fail(exc.message)


@users_app.command("add")
def add_user_command(
    username: str = typer.Argument(..., help="Sign-in name."),
    role: str = typer.Option("reviewer", "--role", help="admin or reviewer."),
    password: str | None = typer.Option(
        None, "--password", help="Password (asked on the terminal when left out)."
    ),
    config: Path | None = ConfigOption,
    as_json: bool = JsonOption,
) -> None:
    """Add a review UI user."""
    from cloud_service.db import crud

    secret = _password(password)
    result = _with_session(
        config,
        lambda s: (lambda u: {"id": u.id, "username": u.username, "role": u.role})(
            crud.create_user(session=s, username=username, password=secret, role=role)
        ),
    )
    if as_json:
        print_json(result)
    else:
        console.print(f"user {result['username']} added ({result['role']})")


@users_app.command("passwd")
def passwd_command(
    username: str = typer.Argument(..., help="Sign-in name."),
    password: str | None = typer.Option(
        None, "--password", help="New password (asked on the terminal when left out)."
    ),
    config: Path | None = ConfigOption,
) -> None:
    """Set a user's password; the user's open sessions end."""
    from cloud_service.db import crud

    secret = _password(password)
    _with_session(
        config, lambda s: crud.set_password(session=s, username=username, password=secret)
    )
    console.print(f"password of {username} changed; their sessions have ended")


@users_app.command("list")
def list_users_command(config: Path | None = ConfigOption, as_json: bool = JsonOption) -> None:
    """List the review UI's users."""
    from cloud_service.db import crud

    rows = _with_session(
        config,
        lambda s: [
            {
                "username": u.username,
                "role": u.role,
                "disabled": u.disabled,
                "created_at": u.created_at.isoformat(timespec="seconds"),
                "last_login_at": u.last_login_at.isoformat(timespec="seconds")
                if u.last_login_at
                else None,
            }
            for u in crud.list_users(session=s)
        ],
    )
    if as_json:
        print_json(rows)
        return
    for row in rows:
        typer.echo(f"{row['username']:<24} {row['role']:<9} last sign-in {row['last_login_at']}")


@app.command("broker")
def run_embedded_broker(
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(1883, help="Port to listen on."),
) -> None:
    """Run the embedded MQTT broker (amqtt, MQTT 3.1.1) in the foreground, for trials."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with EmbeddedBroker(host, port) as broker:
            console.print(f"embedded MQTT broker on [bold]{broker.url}[/] (Ctrl-C stops it)")
            try:
                while not stop.wait(0.5):
                    pass
            except KeyboardInterrupt:
                pass
    except EdgeLoopError as exc:
        fail(exc.message)


@app.command("broker-config")
def broker_config_command(
    out: Path = typer.Option(..., "--out", help="Folder for mosquitto.conf, passwd, acl, certs."),
    dev_ca: bool = typer.Option(False, "--dev-ca", help="Generate a development CA and cert."),
    port: int = typer.Option(8883, "--port", help="The agents' TLS listener port."),
    host: str = typer.Option("0.0.0.0", "--host", help="Address of the TLS listeners."),
    service_port: int = typer.Option(
        8884, "--service-port", help="The services' TLS listener port (0: none)."
    ),
    plain_port: int | None = typer.Option(
        None, "--plain-port", help="Also a plaintext listener on 127.0.0.1 for the services."
    ),
    max_queued_messages: int = typer.Option(
        100_000, "--max-queued-messages", min=1, help="QoS 1 messages queued per client."
    ),
    max_queued_bytes: int = typer.Option(
        512 * 1024 * 1024, "--max-queued-bytes", min=1, help="Payload bytes queued per client."
    ),
    config: Path | None = ConfigOption,
    as_json: bool = JsonOption,
) -> None:
    """Write a Mosquitto configuration: TLS listeners, password files, per-agent ACLs."""
    from cloud_service.brokerconf import max_packet_size, service_files, write_broker_config

    settings = load_settings(CloudSettings, config)
    packet_limit = max_packet_size(settings.max_header_bytes, settings.max_image_bytes)
    try:
        files = write_broker_config(
            out,
            topics=settings.topics,
            tls_port=port,
            host=host,
            service_port=service_port or None,
            plain_port=plain_port,
            dev_ca=dev_ca,
            max_queued_messages=max_queued_messages,
            max_queued_bytes=max_queued_bytes,
            packet_limit=packet_limit,
        )
    except EdgeLoopError as exc:
        fail(exc.message)
    folder = files.password_file.parent
    services = service_files(folder)
    view: dict[str, Any] = {
        "config": str(folder / "mosquitto.conf"),
        "password_file": str(files.password_file),
        "acl_file": str(files.acl_file),
        "service_password_file": str(services.password_file),
        "service_acl_file": str(services.acl_file),
        "pid_file": str(files.pid_file),
        "ca_file": str(folder / "ca.crt"),
        "agent_port": port,
        "service_port": service_port or None,
        "plain_port": plain_port,
        "max_packet_size": packet_limit,
        "service_credentials": [str(folder / "verifier.env"), str(folder / "api.env")],
        "api_settings": {"broker_auth": True, "broker_config_dir": str(folder)},
    }
    if as_json:
        print_json(view)
        return
    console.print(f"wrote {view['config']} (run: mosquitto -c {view['config']})")
    console.print(
        f"agents connect to port {port} (TLS); the services to "
        + " or ".join(
            x
            for x in (
                f"port {service_port} (TLS)" if service_port else "",
                f"127.0.0.1:{plain_port} (plaintext)" if plain_port else "",
            )
            if x
        )
    )
    console.print(f"service credentials (mode 0600): {', '.join(view['service_credentials'])}")
    console.print(
        f"set EDGELOOP_BROKER_AUTH=true and EDGELOOP_BROKER_CONFIG_DIR={folder} on the API, "
        f"and EDGELOOP_AGENT_MQTT_URL=mqtts://<this host>:{port}"
    )


@keys_app.command("init")
def init_signing_key(
    config: Path | None = ConfigOption,
    force: bool = typer.Option(False, "--force", help="Replace an existing key."),
    as_json: bool = JsonOption,
) -> None:
    """Create the fleet's ed25519 signing key (once) and print its public half."""
    settings = load_settings(CloudSettings, config)
    path = settings.resolved_signing_key_file
    if path.exists() and not force:
        key = FleetSigningKey.load(path)
        created = False
    else:
        key = FleetSigningKey.generate()
        key.save(path)
        created = True
    result = {
        "path": str(path),
        "created": created,
        "key_id": key.key_id,
        "public_key": key.public_key_b64,
    }
    if as_json:
        print_json(result)
        return
    verb = "created" if created else "exists"
    console.print(f"signing key {verb}: {path}")
    console.print(f"key id:     {key.key_id}")
    console.print(f"public key: {key.public_key_b64}  (enroll agents with this)")


@keys_app.command("show")
def show_public_key(config: Path | None = ConfigOption, as_json: bool = JsonOption) -> None:
    """Print the fleet's public key (never the private key)."""
    settings = load_settings(CloudSettings, config)
    path = settings.resolved_signing_key_file
    if not path.exists():
        fail(f"no signing key at {path}: run `cloud-service keys init`")
    try:
        key = FleetSigningKey.load(path)
    except EdgeLoopError as exc:
        fail(exc.message)
    result = {"path": str(path), "key_id": key.key_id, "public_key": key.public_key_b64}
    if as_json:
        print_json(result)
    else:
        console.print(f"key id:     {key.key_id}\npublic key: {key.public_key_b64}")


if __name__ == "__main__":
    app()
