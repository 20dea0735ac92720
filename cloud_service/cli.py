"""``cloud-service``: the command line of the cloud processes."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import typer

from cloud_service.settings import CloudSettings
from shared.broker import EmbeddedBroker
from shared.console import (
    ConfigOption,
    JsonOption,
    console,
    fail,
    load_settings,
    print_json,
    settings_view,
)
from shared.errors import EdgeLoopError
from shared.manifest import FleetSigningKey

app = typer.Typer(help="EdgeLoop cloud service: ingest, verifier, API.", no_args_is_help=True)
keys_app = typer.Typer(help="The fleet's model-signing key.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")


@app.command("settings")
def show_settings(config: Path | None = ConfigOption, as_json: bool = JsonOption) -> None:
    """Print the effective settings (file + environment), secrets redacted."""
    view = settings_view(load_settings(CloudSettings, config))
    if as_json:
        print_json(view)
        return
    for key in sorted(view):
        typer.echo(f"{key} = {view[key]}")


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
