"""Topics: names, parsing, filters and MQTT wildcard matching."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.errors import ConfigError, InvalidIdError, TopicError
from shared.topics import ID_PATTERN, TopicRef, Topics, topic_matches, validate_id

ids = st.from_regex(ID_PATTERN, fullmatch=True)
TOPICS = Topics()


def test_topic_names() -> None:
    t = TOPICS
    assert t.samples("f1", "a1") == "edgeloop/v1/f1/a1/samples"
    assert t.receipts("f1", "a1") == "edgeloop/v1/f1/a1/receipts"
    assert t.verdicts("f1", "a1") == "edgeloop/v1/f1/a1/verdicts"
    assert t.status("f1", "a1") == "edgeloop/v1/f1/a1/status"
    assert t.fleet_models("f1") == "edgeloop/v1/f1/models"
    assert t.agent_models("f1", "a1") == "edgeloop/v1/f1/a1/models"
    assert t.model_status("f1", "a1") == "edgeloop/v1/f1/a1/model-status"
    assert Topics("site/x/v2").samples("f", "a") == "site/x/v2/f/a/samples"


def test_filters() -> None:
    assert TOPICS.samples_filter() == "edgeloop/v1/+/+/samples"
    assert TOPICS.samples_filter("verifiers") == "$share/verifiers/edgeloop/v1/+/+/samples"
    assert TOPICS.status_filter() == "edgeloop/v1/+/+/status"
    assert TOPICS.status_filter("ops") == "$share/ops/edgeloop/v1/+/+/status"
    assert TOPICS.model_status_filter() == "edgeloop/v1/+/+/model-status"
    with pytest.raises(InvalidIdError):
        TOPICS.samples_filter("a/b")
    with pytest.raises(InvalidIdError):
        TOPICS.samples_filter("#")


def test_invalid_id_message_says_what_is_accepted() -> None:
    with pytest.raises(InvalidIdError) as info:
        TOPICS.samples("fleet", "Foo!")
    assert str(info.value) == (
        "agent id 'Foo!' is not valid: use 1-64 characters of a-z, 0-9, '_' and '-',"
        " starting with a letter or digit"
    )
    with pytest.raises(InvalidIdError, match=r"^id 'x y'"):
        validate_id("x y")


@pytest.mark.parametrize(
    "bad",
    ["", "-a", "_a", "A", "a/b", "a+", "#", "a b", "é", "a" * 65, "a\n", None, 3, "$sys"],
)
def test_builders_refuse_invalid_ids(bad: object) -> None:
    with pytest.raises(InvalidIdError):
        TOPICS.samples(bad, "agent")  # type: ignore[arg-type]
    with pytest.raises(InvalidIdError):
        TOPICS.verdicts("fleet", bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidIdError):
        TOPICS.fleet_models(bad)  # type: ignore[arg-type]


def test_ids_at_the_length_limit() -> None:
    assert validate_id("a" * 64) == "a" * 64
    assert validate_id("0") == "0"


@pytest.mark.parametrize(
    "prefix", ["", "/edgeloop", "edgeloop/", "edge//loop", "$edge", "edge/+/v1", "edge/#", "a\x00b"]
)
def test_bad_prefixes_are_refused(prefix: str) -> None:
    with pytest.raises(ConfigError, match="topic prefix"):
        Topics(prefix)


@settings(max_examples=300, deadline=None, database=None)
@given(fleet=ids, agent=ids)
def test_build_parse_round_trip(fleet: str, agent: str) -> None:
    cases = {
        TOPICS.samples(fleet, agent): TopicRef("samples", fleet, agent),
        TOPICS.receipts(fleet, agent): TopicRef("receipts", fleet, agent),
        TOPICS.verdicts(fleet, agent): TopicRef("verdicts", fleet, agent),
        TOPICS.status(fleet, agent): TopicRef("status", fleet, agent),
        TOPICS.fleet_models(fleet): TopicRef("models", fleet, None),
        TOPICS.agent_models(fleet, agent): TopicRef("models", fleet, agent),
        TOPICS.model_status(fleet, agent): TopicRef("model-status", fleet, agent),
    }
    for topic, ref in cases.items():
        assert TOPICS.parse(topic) == ref
        assert TOPICS.build(ref) == topic


@pytest.mark.parametrize(
    "topic",
    [
        "other/v1/f/a/samples",
        "edgeloop/v1",
        "edgeloop/v1/",
        "edgeloop/v1x/f/a/samples",
        "edgeloop/v1/f",
        "edgeloop/v1/f/a",
        "edgeloop/v1/f/status",
        "edgeloop/v1/f/a/samples/extra",
        "edgeloop/v1/f/a/unknown",
        "edgeloop/v1/f/a/Samples",
        "edgeloop/v1/F/a/samples",
        "edgeloop/v1/f/a!/samples",
        "edgeloop/v1/f//samples",
        "edgeloop/v1/f/a/samples/",
        "edgeloop/v1/+/+/samples",
        "$share/verifiers/edgeloop/v1/f/a/samples",
        "",
    ],
)
def test_parse_refuses_foreign_or_malformed_topics(topic: str) -> None:
    with pytest.raises(TopicError):
        TOPICS.parse(topic)


def test_parse_wraps_invalid_ids_once() -> None:
    with pytest.raises(TopicError, match="invalid id") as info:
        TOPICS.parse("edgeloop/v1/fleet/Bad/samples")
    assert isinstance(info.value.__cause__, InvalidIdError)


def test_build_needs_an_agent_except_for_fleet_models() -> None:
    with pytest.raises(TopicError):
        TOPICS.build(TopicRef("samples", "f", None))


@pytest.mark.parametrize(
    ("topic_filter", "topic", "expected"),
    [
        ("a/b/c", "a/b/c", True),
        ("a/b/c", "a/b", False),
        ("a/b", "a/b/c", False),
        ("a/+/c", "a/b/c", True),
        ("a/+/c", "a//c", True),  # '+' matches an empty level
        ("a/+/c", "a/b/d", False),
        ("+", "a", True),
        ("+", "/a", False),
        ("+/+", "/a", True),
        ("/+", "/a", True),
        ("a/#", "a", True),  # '#' includes the parent level
        ("a/#", "a/b/c", True),
        ("a/#", "ab", False),
        ("a/b/#", "a", False),
        ("#", "a/b/c", True),
        ("#", "/", True),
        ("#", "$SYS/broker/load", False),
        ("+/broker/load", "$SYS/broker/load", False),
        ("$SYS/#", "$SYS/broker/load", True),
        ("$SYS/+/load", "$SYS/broker/load", True),
        ("A/b", "a/b", False),  # case sensitive
        ("edgeloop/v1/+/+/samples", "edgeloop/v1/f/a/samples", True),
        ("edgeloop/v1/+/+/samples", "edgeloop/v1/f/a/verdicts", False),
        ("edgeloop/v1/+/+/samples", "edgeloop/v1/f/models", False),
        ("$share/verifiers/edgeloop/v1/+/+/samples", "edgeloop/v1/f/a/samples", True),
        ("$share/verifiers/edgeloop/v1/+/+/samples", "edgeloop/v1/f/a/status", False),
        ("$share/g/#", "a/b", True),
        ("$share/g/#", "$SYS/x", False),
        ("edgeloop/v1/+/models", "edgeloop/v1/f/models", True),
        ("edgeloop/v1/+/+/models", "edgeloop/v1/f/models", False),
    ],
)
def test_wildcard_matching(topic_filter: str, topic: str, expected: bool) -> None:
    assert topic_matches(topic_filter, topic) is expected


@pytest.mark.parametrize(
    ("topic_filter", "topic"),
    [
        ("a/#/b", "a/x/b"),
        ("a+/b", "a/b"),
        ("a/b#", "a/b"),
        ("", "a"),
        ("$share/g", "a"),
        ("$share//a", "a"),
        ("$share/g+/a", "a"),
        ("a/+", "a/+"),
        ("a/#", "a/#"),
        ("a", ""),
    ],
)
def test_malformed_filters_and_topics_are_refused(topic_filter: str, topic: str) -> None:
    with pytest.raises(TopicError):
        topic_matches(topic_filter, topic)


@settings(max_examples=200, deadline=None, database=None)
@given(fleet=ids, agent=ids)
def test_built_filters_match_built_topics(fleet: str, agent: str) -> None:
    for group in (None, "verifiers"):
        assert topic_matches(TOPICS.samples_filter(group), TOPICS.samples(fleet, agent))
        assert topic_matches(TOPICS.status_filter(group), TOPICS.status(fleet, agent))
        assert topic_matches(TOPICS.model_status_filter(group), TOPICS.model_status(fleet, agent))
        assert not topic_matches(TOPICS.samples_filter(group), TOPICS.status(fleet, agent))
        assert not topic_matches(TOPICS.status_filter(group), TOPICS.fleet_models(fleet))


topic_text = st.text(alphabet=st.sampled_from("ab/+#$ \x00e1v-_"), max_size=30)


@settings(max_examples=500, deadline=None, database=None)
@given(topic_filter=topic_text, topic=topic_text)
def test_garbage_only_raises_topic_errors(topic_filter: str, topic: str) -> None:
    with contextlib.suppress(TopicError):
        assert isinstance(topic_matches(topic_filter, topic), bool)
    with contextlib.suppress(TopicError):
        TOPICS.parse(topic)
