"""MQTT topic names, subscription filters and wildcard matching.

The layout (docs/architecture.md, "Topics"), under a configurable prefix:

    {prefix}/{fleet}/{agent}/samples        agent -> cloud   sample envelope
    {prefix}/{fleet}/{agent}/receipts       cloud -> agent   stored sample ids
    {prefix}/{fleet}/{agent}/verdicts       cloud -> agent   verdict
    {prefix}/{fleet}/{agent}/status         agent -> cloud   heartbeat, last will
    {prefix}/{fleet}/models                 cloud -> fleet   model announcement
    {prefix}/{fleet}/{agent}/models         cloud -> agent   canary announcement
    {prefix}/{fleet}/{agent}/model-status   agent -> cloud   update progress

Fleet and agent ids are checked before they reach a topic, so an id can never
smuggle in a level separator or a wildcard.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, cast, get_args

from shared.errors import ConfigError, InvalidIdError, TopicError

__all__ = [
    "DEFAULT_PREFIX",
    "ID_PATTERN",
    "TopicKind",
    "TopicRef",
    "Topics",
    "topic_matches",
    "validate_id",
]

ID_PATTERN = r"[a-z0-9][a-z0-9_-]{0,63}"
DEFAULT_PREFIX = "edgeloop/v1"

TopicKind = Literal["samples", "receipts", "verdicts", "status", "models", "model-status"]
_KINDS: frozenset[str] = frozenset(get_args(TopicKind))
_ID_RE = re.compile(ID_PATTERN)
_SHARE = "$share/"


def _shown(value: object) -> str:
    """Return a short repr of untrusted input for an error message."""
    if isinstance(value, str) and len(value) > 70:
        return repr(value[:70]) + "..."
    return repr(value)


def validate_id(value: object, kind: str = "id") -> str:
    """Return ``value`` if it is a valid fleet/agent id, else raise InvalidIdError."""
    if isinstance(value, str) and _ID_RE.fullmatch(value):
        return value
    label = "id" if kind == "id" else f"{kind} id"
    raise InvalidIdError(
        f"{label} {_shown(value)} is not valid: use 1-64 characters of a-z, 0-9, '_' and '-',"
        " starting with a letter or digit"
    )


@dataclass(frozen=True)
class TopicRef:
    """What a topic names: its kind, its fleet and (except fleet-wide models) its agent."""

    kind: TopicKind
    fleet: str
    agent: str | None = None


def _check_prefix(prefix: str) -> None:
    """Raise ConfigError unless ``prefix`` can head every EdgeLoop topic."""
    problem = None
    if not isinstance(prefix, str) or not prefix:
        problem = "it is empty"
    elif prefix.startswith("$"):
        problem = "it starts with '$' (reserved for broker topics)"
    elif "+" in prefix or "#" in prefix:
        problem = "it contains an MQTT wildcard"
    elif "\x00" in prefix:
        problem = "it contains a NUL character"
    elif any(segment == "" for segment in prefix.split("/")):
        problem = "it has an empty level (a leading, trailing or doubled '/')"
    if problem is not None:
        raise ConfigError(
            f"topic prefix {_shown(prefix)} is not valid: {problem}; use something like"
            f" {DEFAULT_PREFIX!r}"
        )


@dataclass(frozen=True)
class Topics:
    """Builds and parses EdgeLoop topics under one prefix."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        _check_prefix(self.prefix)

    def _agent_topic(self, fleet: str, agent: str, kind: str) -> str:
        fleet = validate_id(fleet, "fleet")
        agent = validate_id(agent, "agent")
        return f"{self.prefix}/{fleet}/{agent}/{kind}"

    def samples(self, fleet: str, agent: str) -> str:
        """Topic an agent publishes sample envelopes on."""
        return self._agent_topic(fleet, agent, "samples")

    def receipts(self, fleet: str, agent: str) -> str:
        """Topic the cloud publishes storage receipts on for one agent."""
        return self._agent_topic(fleet, agent, "receipts")

    def verdicts(self, fleet: str, agent: str) -> str:
        """Topic the cloud publishes verdicts on for one agent."""
        return self._agent_topic(fleet, agent, "verdicts")

    def status(self, fleet: str, agent: str) -> str:
        """Topic of an agent's retained status and last will."""
        return self._agent_topic(fleet, agent, "status")

    def fleet_models(self, fleet: str) -> str:
        """Topic of the retained model announcement for a whole fleet."""
        return f"{self.prefix}/{validate_id(fleet, 'fleet')}/models"

    def agent_models(self, fleet: str, agent: str) -> str:
        """Topic of the retained announcement for one agent (overrides the fleet one)."""
        return self._agent_topic(fleet, agent, "models")

    def model_status(self, fleet: str, agent: str) -> str:
        """Topic an agent reports model update progress on."""
        return self._agent_topic(fleet, agent, "model-status")

    def build(self, ref: TopicRef) -> str:
        """Topic named by ``ref`` (the inverse of ``parse``)."""
        if ref.kind == "models" and ref.agent is None:
            return self.fleet_models(ref.fleet)
        if ref.agent is None:
            raise TopicError(f"a {ref.kind!r} topic needs an agent id")
        return self._agent_topic(ref.fleet, ref.agent, ref.kind)

    def _filter(self, kind: str, shared_group: str | None) -> str:
        plain = f"{self.prefix}/+/+/{kind}"
        if shared_group is None:
            return plain
        return f"{_SHARE}{validate_id(shared_group, 'shared subscription group')}/{plain}"

    def samples_filter(self, shared_group: str | None = None) -> str:
        """Filter for every agent's samples; an MQTT v5 shared subscription if a group is given."""
        return self._filter("samples", shared_group)

    def status_filter(self, shared_group: str | None = None) -> str:
        """Filter for every agent's status, optionally as a shared subscription."""
        return self._filter("status", shared_group)

    def model_status_filter(self, shared_group: str | None = None) -> str:
        """Filter for every agent's model-status, optionally as a shared subscription."""
        return self._filter("model-status", shared_group)

    def parse(self, topic: str) -> TopicRef:
        """Return what ``topic`` names, or raise TopicError if it is not an EdgeLoop topic."""
        if not isinstance(topic, str):
            raise TopicError(f"topic must be a string, got {type(topic).__name__}")
        head = self.prefix + "/"
        if not topic.startswith(head):
            raise TopicError(f"topic {_shown(topic)} is outside the prefix {self.prefix!r}")
        parts = topic[len(head) :].split("/")
        try:
            if len(parts) == 2 and parts[1] == "models":
                return TopicRef("models", validate_id(parts[0], "fleet"), None)
            if len(parts) == 3 and parts[2] in _KINDS:
                return TopicRef(
                    cast(TopicKind, parts[2]),
                    validate_id(parts[0], "fleet"),
                    validate_id(parts[1], "agent"),
                )
        except InvalidIdError as exc:
            raise TopicError(f"topic {_shown(topic)} has an invalid id: {exc}") from exc
        raise TopicError(
            f"topic {_shown(topic)} is not an EdgeLoop topic: expected"
            f" {self.prefix}/{{fleet}}/{{agent}}/{{kind}} with kind one of"
            f" {', '.join(sorted(_KINDS))}, or {self.prefix}/{{fleet}}/models"
        )


def _split_filter(topic_filter: str) -> list[str]:
    """Return the levels of a valid filter, without any $share/{group}/ head."""
    if not isinstance(topic_filter, str) or not topic_filter:
        raise TopicError("topic filter must be a non-empty string")
    if topic_filter.startswith(_SHARE):
        group, sep, rest = topic_filter[len(_SHARE) :].partition("/")
        if not group or not sep or not rest or "+" in group or "#" in group:
            raise TopicError(
                f"shared subscription {_shown(topic_filter)} is malformed: use"
                " $share/{group}/{filter}"
            )
        topic_filter = rest
    levels = topic_filter.split("/")
    for index, level in enumerate(levels):
        if level == "#" and index != len(levels) - 1:
            raise TopicError(f"filter {_shown(topic_filter)}: '#' must be the last level")
        if level not in ("+", "#") and ("+" in level or "#" in level):
            raise TopicError(f"filter {_shown(topic_filter)}: a wildcard must fill a whole level")
    return levels


def topic_matches(topic_filter: str, topic: str) -> bool:
    """Whether ``topic`` matches ``topic_filter`` under MQTT rules (+, #, $share, $-topics)."""
    levels = _split_filter(topic_filter)
    if not isinstance(topic, str) or not topic:
        raise TopicError("topic must be a non-empty string")
    if "+" in topic or "#" in topic:
        raise TopicError(f"topic {_shown(topic)} contains a wildcard")
    names = topic.split("/")
    # MQTT 3.1.1 section 4.7.2: a filter starting with a wildcard does not match
    # topics starting with '$' (such as $SYS/...).
    if names[0].startswith("$") and levels[0] in ("+", "#"):
        return False
    for index, level in enumerate(levels):
        if level == "#":
            return True  # also matches the parent level: "a/#" matches "a"
        if index >= len(names):
            return False
        if level != "+" and level != names[index]:
            return False
    return len(levels) == len(names)
