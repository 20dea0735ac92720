"""One running EdgeLoop system on loopback: broker, database, verifier, API and agents.

    with Stack(broker="embedded", db="sqlite", verifier="in-process", api="in-process",
               teacher=teacher_onnx, student=student_onnx, agents=2) as stack:
        stack.agents[0].process(frame)           # forwarded over MQTT, verified, stored
        stack.worker.counts["verdicts"]

The parts (see docs/architecture.md for what each does):

* ``broker``: ``"embedded"`` (amqtt in this process), ``"mosquitto"`` (a private
  Mosquitto on a free port), a ``MosquittoProcess`` configured by the caller, a URL
  (``mqtt://127.0.0.1:1883``: a broker already running), or None;
* ``db``: ``"sqlite"`` (a file in the stack's folder), ``"postgres"`` (a fresh database
  on the local server, dropped at the end; a SQLite file when no server answers), or
  a SQLAlchemy URL used as given;
* ``verifier``: ``"in-process"`` (``VerifierWorker`` in this process),
  ``subprocess(n)`` (``cloud-service verifier --workers n``), or None;
* ``api``: ``"in-process"`` (the REST API under uvicorn in a thread, announcing over
  the broker), ``"subprocess"`` (``cloud-service api``), or None;
* ``agents``: edge agents started with the stack (``cam-1`` ...), enrolled with their
  own API tokens when the API runs in this process; more with ``add_agent``.

Every cloud part gets the same ``CloudSettings`` (``cloud`` adds fields), every agent
the same ``AgentSettings`` base (``edge`` adds fields). Processes can be killed and
restarted (``stack.verifier.kill()``, ``stack.api.start()``), the private Mosquitto
stopped and started (``stack.broker.stop()``); the parts stop in reverse order.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from shared.broker import EmbeddedBroker, MosquittoProcess
from shared.errors import ConfigError
from shared.mqtt import MqttTarget
from shared.topics import Topics
from simulations.databases import POSTGRES_ADMIN_URL, fresh_database
from simulations.processes import ServiceProcess, settings_env

if TYPE_CHECKING:
    from cloud_service.announce import Announcer
    from cloud_service.settings import CloudSettings
    from cloud_service.web.state import ApiState
    from cloud_service.worker import VerifierWorker
    from edge_agent.agent import Agent
    from edge_agent.engine import OrtEngine
    from edge_agent.settings import AgentSettings

__all__ = [
    "Broker",
    "InProcessApi",
    "InProcessVerifier",
    "Stack",
    "VerifierProcesses",
    "subprocess",
]


@dataclass(frozen=True)
class VerifierProcesses:
    """The verifier as ``cloud-service verifier --workers N``, with extra settings of its own."""

    workers: int = 1
    settings: Mapping[str, Any] = field(default_factory=dict)


def subprocess(workers: int = 1, **settings: Any) -> VerifierProcesses:
    """``verifier=subprocess(2)``: two verifier processes; ``settings`` for them only."""
    return VerifierProcesses(workers, settings)


class Broker:
    """The stack's MQTT broker; only a private Mosquitto can be stopped and started again."""

    def __init__(self, spec: str | MosquittoProcess, folder: Path) -> None:
        self.embedded: EmbeddedBroker | None = None
        self.mosquitto: MosquittoProcess | None = None
        self._url: str | None = None
        if isinstance(spec, MosquittoProcess):
            self.mosquitto = spec
        elif spec == "embedded":
            self.embedded = EmbeddedBroker()
        elif spec == "mosquitto":
            (folder / "broker").mkdir(parents=True, exist_ok=True)
            self.mosquitto = MosquittoProcess(folder / "broker")
        else:
            MqttTarget.parse(spec)
            self._url = spec

    @property
    def url(self) -> str:
        if self.embedded is not None:
            return self.embedded.url
        if self.mosquitto is not None:
            return self.mosquitto.url
        assert self._url is not None
        return self._url

    @property
    def port(self) -> int:
        return MqttTarget.parse(self.url).port

    @property
    def pid(self) -> int | None:
        """The private Mosquitto's process id; None for the others."""
        return self.mosquitto.pid if self.mosquitto is not None else None

    def _own(self) -> MosquittoProcess:
        if self.mosquitto is None:
            raise ConfigError("only a private Mosquitto is stopped and started by the stack")
        return self.mosquitto

    def start(self) -> None:
        if self.embedded is not None:
            self.embedded.start()
        elif self.mosquitto is not None:
            self.mosquitto.start()

    def stop(self) -> None:
        if self.embedded is not None:
            self.embedded.stop()
        elif self.mosquitto is not None:
            self.mosquitto.stop()

    def restart(self) -> None:
        self._own().restart()


class InProcessVerifier:
    """``VerifierWorker`` in this process, on the stack's settings."""

    def __init__(self, settings: CloudSettings) -> None:
        from cloud_service.worker import VerifierWorker

        self.worker = VerifierWorker(settings)

    @property
    def pid(self) -> int:
        return os.getpid()

    def start(self) -> InProcessVerifier:
        self.worker.start()
        return self

    def stop(self) -> None:
        self.worker.stop()


class InProcessApi:
    """The cloud's REST API under uvicorn in a thread of this process."""

    def __init__(
        self, settings: CloudSettings, *, worker: VerifierWorker | None, announcer: Announcer
    ) -> None:
        from cloud_service.api import create_app
        from edge_agent.sources.http import ApiServer

        self.announcer = announcer
        self.app = create_app(settings, worker=worker, announcer=announcer)
        self.state: ApiState = self.app.state.edgeloop
        self.server = ApiServer(self.app)

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> InProcessApi:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()
        self.announcer.close()


class Stack:
    """Broker, database, verifier, API and agents, started by ``with`` and stopped after."""

    def __init__(
        self,
        folder: Path | None = None,
        *,
        broker: str | MosquittoProcess | None = "embedded",
        db: str = "sqlite",
        verifier: Literal["in-process"] | VerifierProcesses | None = "in-process",
        api: Literal["in-process", "subprocess"] | None = None,
        agents: int = 0,
        teacher: Path | None = None,
        student: Path | None = None,
        fleet: str = "demo",
        topic_prefix: str = "edgeloop/v1",
        cloud: Mapping[str, Any] | None = None,
        edge: Mapping[str, Any] | None = None,
        name: str = "stack",
        postgres_admin_url: str = POSTGRES_ADMIN_URL,
    ) -> None:
        self._folder = folder
        self._broker_spec = broker
        self._db = db
        self._verifier_spec = verifier
        self._api_spec = api
        self._agent_count = agents
        self.teacher = teacher
        self.student = student
        self.fleet = fleet
        self.topics = Topics(prefix=topic_prefix)
        self.cloud = dict(cloud or {})
        self.edge = dict(edge or {})
        self.name = name
        self.postgres_admin_url = postgres_admin_url
        self.broker: Broker | None = None
        self.database_url = ""
        self.verifier: InProcessVerifier | ServiceProcess | None = None
        self.api: InProcessApi | ServiceProcess | None = None
        self.agents: list[Agent] = []
        self._engine: OrtEngine | None = None
        self._exit = ExitStack()

    # --- lifecycle ---------------------------------------------------------------

    @property
    def folder(self) -> Path:
        if self._folder is None:
            raise ConfigError("the stack has not started: its folder is made on start")
        return self._folder

    def start(self) -> Stack:
        """Start every part the stack was given, in order; on a failure, stop what started."""
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        exit_ = self._exit
        if self._folder is None:
            made = tempfile.TemporaryDirectory(
                prefix=f"edgeloop-{self.name}-", ignore_cleanup_errors=True
            )
            self._folder = Path(exit_.enter_context(made))
        self._folder.mkdir(parents=True, exist_ok=True)
        if self._broker_spec is not None:
            self.broker = Broker(self._broker_spec, self.folder)
            self.broker.start()
            exit_.callback(self.broker.stop)
        sqlite = self.folder / "cloud.db"
        if self._db == "sqlite":
            self.database_url = f"sqlite:///{sqlite}"
        elif self._db == "postgres":
            database = fresh_database(
                self.postgres_admin_url, prefix=f"edgeloop_{self.name}", fallback=sqlite
            )
            self.database_url = exit_.enter_context(database)
        else:
            self.database_url = self._db
        if self._verifier_spec == "in-process":
            self.verifier = InProcessVerifier(self.cloud_settings()).start()
            exit_.callback(self.verifier.stop)
        elif isinstance(self._verifier_spec, VerifierProcesses):
            spec = self._verifier_spec
            self.verifier = self.verifier_process(workers=spec.workers, **spec.settings).start()
        if self._api_spec == "in-process":
            self.api = self._in_process_api().start()
            exit_.callback(self.api.stop)
        elif self._api_spec == "subprocess":
            self.api = self.api_process().start()
        for i in range(self._agent_count):
            self.add_agent(f"cam-{i + 1}")

    def _in_process_api(self) -> InProcessApi:
        from cloud_service.announce import MemoryAnnouncer, MqttAnnouncer

        settings = self.cloud_settings()
        announcer: Announcer = (
            MqttAnnouncer(settings.mqtt, client_id=f"{self.name}-announcer")
            if self.broker is not None
            else MemoryAnnouncer()
        )
        worker = self.verifier.worker if isinstance(self.verifier, InProcessVerifier) else None
        return InProcessApi(settings, worker=worker, announcer=announcer)

    def close(self) -> None:
        """Stop the agents, the API, the verifier, the database and the broker."""
        self._exit.close()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the parts ---------------------------------------------------------------

    @property
    def worker(self) -> VerifierWorker:
        """The in-process verifier's worker."""
        if not isinstance(self.verifier, InProcessVerifier):
            raise ConfigError("the stack runs no verifier in this process")
        return self.verifier.worker

    @property
    def state(self) -> ApiState:
        """The in-process API's state: sessions, blobs, signing key."""
        if not isinstance(self.api, InProcessApi):
            raise ConfigError("the stack runs no API in this process")
        return self.api.state

    @property
    def api_url(self) -> str:
        if self.api is None:
            raise ConfigError("the stack runs no API")
        return self.api.url

    def cloud_values(self, **overrides: Any) -> dict[str, Any]:
        """The ``CloudSettings`` fields every cloud part of the stack gets, plus ``overrides``."""
        values: dict[str, Any] = {
            "data_dir": self.folder / "cloud",
            "topic_prefix": self.topics.prefix,
            "database_url": self.database_url,
        }
        if self.broker is not None:
            values["mqtt_url"] = self.broker.url
        if self.teacher is not None:
            values["teacher_model"] = self.teacher
        return {**values, **self.cloud, **overrides}

    def cloud_settings(self, **overrides: Any) -> CloudSettings:
        from cloud_service.settings import CloudSettings

        return CloudSettings(**self.cloud_values(**overrides))

    def _process(self, kind: Literal["verifier", "api"], **options: Any) -> ServiceProcess:
        workers = int(options.pop("workers", 1))
        launch = {
            k: options.pop(k)
            for k in ("ready_timeout_s", "stop_timeout_s", "checkout")
            if k in options
        }
        extra_env: Mapping[str, str] = options.pop("env", {})
        env = {
            **settings_env({"log_level": "WARNING", **self.cloud_values(**options)}),
            **extra_env,
        }
        process = ServiceProcess(
            kind, env, workers=workers, log=self.folder / f"{kind}.log", **launch
        )
        self._exit.callback(process.close)
        return process

    def verifier_process(self, **options: Any) -> ServiceProcess:
        """A ``cloud-service verifier`` launcher (not started), stopped with the stack.

        ``workers``, ``ready_timeout_s``, ``stop_timeout_s`` and ``checkout`` (another
        checkout of the project to run it from) shape the launch, ``env`` adds variables
        after the stack's; any other keyword is a ``CloudSettings`` field for this process
        only.
        """
        return self._process("verifier", **options)

    def api_process(self, **options: Any) -> ServiceProcess:
        """A ``cloud-service api`` launcher (not started), stopped with the stack."""
        return self._process("api", **options)

    # --- agents ------------------------------------------------------------------

    @property
    def engine(self) -> OrtEngine:
        """One ONNX Runtime engine on the stack's student, for agents that share it."""
        if self._engine is None:
            from edge_agent.engine import EngineOptions, OrtEngine

            if self.student is None:
                raise ConfigError("the stack has no student model")
            self._engine = OrtEngine(self.student, EngineOptions(intra_op_threads=1, warmup_runs=1))
        return self._engine

    def agent_settings(self, agent_id: str = "cam-1", **overrides: Any) -> AgentSettings:
        """An agent's settings: its folder, the student, the broker and the stack's ``edge``."""
        from edge_agent.settings import AgentSettings

        values: dict[str, Any] = {
            "data_dir": self.folder / agent_id,
            "fleet": self.fleet,
            "agent_id": agent_id,
            "topic_prefix": self.topics.prefix,
        }
        if self.student is not None:
            values["model_path"] = self.student
        if self.broker is not None:
            values["mqtt_url"] = self.broker.url
            if self.broker.embedded is not None:
                values["mqtt_protocol"] = "3.1.1"  # amqtt speaks MQTT 3.1.1
        if isinstance(self.api, InProcessApi):
            values["fleet_public_key"] = self.state.signing_key.public_key_b64
            values["cloud_url"] = self.api.url
        return AgentSettings(**{**values, **self.edge, **overrides})

    def _enroll(self, agent_id: str) -> dict[str, Any]:
        """The agent's API token, when the API runs here to enroll it."""
        if not isinstance(self.api, InProcessApi):
            return {}
        from cloud_service.db import crud

        with self.state.sessions.begin() as session:
            one_time, _ = crud.create_enrollment_token(
                session=session, fleet=self.fleet, agent_id=agent_id, ttl_s=600
            )
            _, api_token = crud.enroll_agent(session=session, token=one_time, agent_id=agent_id)
        return {"api_token": api_token}

    def agent(
        self,
        agent_id: str = "cam-1",
        *,
        settings: Mapping[str, Any] | None = None,
        cls: type[Agent] | None = None,
        **kwargs: Any,
    ) -> Agent:
        """An agent (``cls``, an ``Agent`` by default), enrolled when it can be; not started.

        ``settings`` adds ``AgentSettings`` fields; ``kwargs`` go to the constructor.
        """
        from edge_agent.agent import Agent

        values = {**self._enroll(agent_id), **(settings or {})}
        return (cls or Agent)(self.agent_settings(agent_id, **values), **kwargs)

    def add_agent(
        self,
        agent_id: str,
        *,
        settings: Mapping[str, Any] | None = None,
        cls: type[Agent] | None = None,
        **kwargs: Any,
    ) -> Agent:
        """``agent(...)`` started, kept in ``agents`` and stopped with the stack."""
        made = self._exit.enter_context(self.agent(agent_id, settings=settings, cls=cls, **kwargs))
        self.agents.append(made)
        return made
