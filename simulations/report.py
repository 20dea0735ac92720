"""The closed loop's HTML report: one self-contained file (inline SVG plots, no scripts).

    write_report(Path("loop.html"), report)   # report: what run_closed_loop returned

Plots along the fleet's live stream (frames in the order the agents answered them):
edge accuracy, forward rate, and latency (the edge's answer, and capture to verdict
for forwarded frames), each with the phases shaded, the distillation round marked
with its duration, and the frame where each model version first answered marked (one
marker per round's model). Then the headline table (a column per round), the goals
with the column each reads, and each round's distillation job.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2 import Environment
from markupsafe import Markup

from simulations.loop_table import table_header, table_rows

__all__ = ["render_report", "write_report"]

_W, _H = 760, 240
_PAD_L, _PAD_R, _PAD_T, _PAD_B = 56, 16, 26, 34
_SPAN_COLOURS = {
    "clean": "#e8f3e8",
    "drifted": "#fbe9e2",
    "distillation round": "#e6ecf7",
    "after one round": "#eef6ee",
}


def _span_colour(label: str) -> str:
    if label in _SPAN_COLOURS:
        return _SPAN_COLOURS[label]
    if label.startswith("after round"):
        return "#eef6ee"
    if label.startswith("drifted"):
        return "#fbe9e2"
    return "#f2f2f2"


Point = tuple[float, float]
Segment = list[Point]  # one phase's points; lines break between phases


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _segments(
    rows: Sequence[tuple[int, str, float]], size: int
) -> list[list[tuple[float, list[float]]]]:
    """Rows (n, phase, value) -> per phase, bins of ``size``: (mean n, values)."""
    out: list[list[tuple[float, list[float]]]] = []
    phase: str | None = None
    current: list[tuple[int, str, float]] = []

    def flush_bin() -> None:
        if current:
            out[-1].append((sum(r[0] for r in current) / len(current), [r[2] for r in current]))
            current.clear()

    for row in sorted(rows):
        if row[1] != phase:
            flush_bin()
            out.append([])
            phase = row[1]
        current.append(row)
        if len(current) >= size:
            flush_bin()
    flush_bin()
    return out


def _series(timeline: dict[str, Any]) -> dict[str, list[Segment]]:
    frames = timeline.get("frames", [])
    phase_of = [row[1] for row in frames]
    size = max(10, len(frames) // 90)

    def binned(index: int, reduce: str) -> list[Segment]:
        rows = [(n, row[1], float(row[index])) for n, row in enumerate(frames)]
        return [
            [(x, sum(v) / len(v) if reduce == "mean" else _median(v)) for x, v in seg]
            for seg in _segments(rows, size)
        ]

    verdict_rows = [
        (int(n), phase_of[int(n)] if int(n) < len(phase_of) else "", float(ms))
        for n, _t, ms in timeline.get("verdicts", [])
    ]
    verdicts = [
        [(x, _median(v)) for x, v in seg]
        for seg in _segments(verdict_rows, max(3, len(verdict_rows) // 60))
    ]
    return {
        "accuracy": binned(4, "mean"),
        "forward": binned(5, "mean"),
        "edge_ms": binned(6, "median"),
        "verdict_ms": verdicts,
    }


def _version_marks(timeline: dict[str, Any]) -> list[tuple[float, str]]:
    """Where each model version first answered a live frame on any agent."""
    first: dict[str, float] = {}
    for n, _agent, version in timeline.get("versions", []):
        first[version] = min(float(n), first.get(version, float(n)))
    return sorted((n, v) for v, n in first.items())


def line_chart(
    title: str,
    series: Sequence[tuple[str, str, Sequence[Segment]]],
    *,
    n_max: float,
    y_max: float,
    y_format: str,
    spans: Sequence[Sequence[Any]] = (),
    versions: Sequence[tuple[float, str]] = (),
    marks: Sequence[Sequence[Any]] = (),
) -> str:
    """An SVG line chart over the live stream; ``series`` = (name, colour, segments)."""
    pw, ph = _W - _PAD_L - _PAD_R, _H - _PAD_T - _PAD_B
    n_max = max(n_max, 1.0)
    y_max = max(y_max, 1e-9)

    def x(n: float) -> float:
        return _PAD_L + pw * n / n_max

    def y(v: float) -> float:
        return _PAD_T + ph * (1 - min(v, y_max) / y_max)

    esc = html.escape
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_W} {_H}" width="{_W}"'
        f' height="{_H}" font-family="sans-serif" font-size="11" role="img"'
        f' aria-label="{esc(title)}">',
        f'<text x="{_PAD_L}" y="15" font-size="13" font-weight="bold">{esc(title)}</text>',
    ]
    for name, n0, n1, t0, t1 in spans:
        label = str(name)
        if n1 > n0:
            colour = _span_colour(label)
            out.append(
                f'<rect class="span" x="{x(n0):.1f}" y="{_PAD_T}"'
                f' width="{x(n1) - x(n0):.1f}" height="{ph}" fill="{colour}">'
                f"<title>{esc(label)}: {t1 - t0:.0f} s</title></rect>"
            )
            out.append(
                f'<text x="{x(n0) + 3:.1f}" y="{_PAD_T + 11}" fill="#666">{esc(label)}</text>'
            )
        else:  # happened between two frames: the distillation round
            out.append(
                f'<line class="round" x1="{x(n0):.1f}" x2="{x(n0):.1f}" y1="{_PAD_T}"'
                f' y2="{_H - _PAD_B}" stroke="#3b5ba5" stroke-width="4" opacity="0.5">'
                f"<title>{esc(label)}: {t1 - t0:.0f} s</title></line>"
            )
            out.append(
                f'<text x="{x(n0) - 4:.1f}" y="{_PAD_T + 24}" text-anchor="end" fill="#3b5ba5">'
                f"{esc(label)}, {t1 - t0:.0f} s</text>"
            )
    for i in range(5):
        v = y_max * i / 4
        out.append(
            f'<line x1="{_PAD_L}" x2="{_W - _PAD_R}" y1="{y(v):.1f}" y2="{y(v):.1f}"'
            ' stroke="#ddd"/>'
        )
        out.append(
            f'<text x="{_PAD_L - 6}" y="{y(v) + 4:.1f}" text-anchor="end">'
            f"{esc(y_format.format(v))}</text>"
        )
    for i in range(6):
        n = n_max * i / 5
        out.append(
            f'<text x="{x(n):.1f}" y="{_H - _PAD_B + 14}" text-anchor="middle">{n:.0f}</text>'
        )
    out.append(
        f'<text x="{_PAD_L + pw / 2:.1f}" y="{_H - 4}" text-anchor="middle" fill="#666">'
        "live frames answered by the fleet</text>"
    )
    for n, text in marks:
        out.append(
            f'<line x1="{x(n):.1f}" x2="{x(n):.1f}" y1="{_PAD_T}" y2="{_H - _PAD_B}"'
            f' stroke="#999" stroke-dasharray="2 3"><title>{esc(str(text))}</title></line>'
        )
    for n, version in versions:
        out.append(
            f'<line class="version-marker" data-version="{esc(version)}" x1="{x(n):.1f}"'
            f' x2="{x(n):.1f}" y1="{_PAD_T}" y2="{_H - _PAD_B}" stroke="#6a3d9a"'
            ' stroke-width="1.5"/>'
        )
        out.append(
            f'<text x="{x(n) + 3:.1f}" y="{_H - _PAD_B - 4}" fill="#6a3d9a">'
            f"model {esc(version)}</text>"
        )
    for k, (name, colour, segments) in enumerate(series):
        for segment in segments:
            if not segment:
                continue
            path = " ".join(f"{x(n):.1f},{y(v):.1f}" for n, v in segment)
            out.append(
                f'<polyline fill="none" stroke="{colour}" stroke-width="1.8" points="{path}">'
                f"<title>{esc(name)}</title></polyline>"
            )
        lx = _W - _PAD_R - 170
        ly = _PAD_T + 8 + 14 * k
        out.append(
            f'<rect x="{lx}" y="{ly - 8}" width="10" height="3" fill="{colour}"/>'
            f'<text x="{lx + 14}" y="{ly - 3}">{esc(name)}</text>'
        )
    out.append(
        f'<line x1="{_PAD_L}" x2="{_W - _PAD_R}" y1="{_H - _PAD_B}" y2="{_H - _PAD_B}"'
        ' stroke="#333"/>'
    )
    out.append("</svg>")
    return "\n".join(out)


def plots(report: dict[str, Any]) -> dict[str, str]:
    """The report's three SVG plots, by name."""
    timeline = report.get("timeline", {})
    s = _series(timeline)
    common: dict[str, Any] = {
        "n_max": max(1, len(timeline.get("frames", []))),
        "spans": timeline.get("spans", []),
        "versions": _version_marks(timeline),
        "marks": timeline.get("marks", []),
    }

    def top(segments: list[Segment]) -> float:
        return max((v for seg in segments for _, v in seg), default=0.0)

    forward_top = top(s["forward"])
    return {
        "accuracy": line_chart(
            "Edge accuracy (top-1 of the agents' answers)",
            [("edge top-1", "#3b7dd8", s["accuracy"])],
            y_max=1.0,
            y_format="{:.0%}",
            **common,
        ),
        "forward": line_chart(
            "Forward rate (share of frames sent to the cloud)",
            [("forwarded", "#e07b39", s["forward"])],
            y_max=1.0 if forward_top > 0.75 else max(0.25, forward_top * 1.25),
            y_format="{:.0%}",
            **common,
        ),
        "latency": line_chart(
            "Latency, median per bin",
            [
                ("edge answer (ms)", "#2ca02c", s["edge_ms"]),
                ("capture to verdict (ms)", "#9467bd", s["verdict_ms"]),
            ],
            y_max=max(top(s["edge_ms"]), top(s["verdict_ms"]), 1.0) * 1.15,
            y_format="{:.0f} ms",
            **common,
        ),
    }


_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>EdgeLoop closed loop: drift {{ r.drift }}</title>
<style>
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 820px; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
td, th { padding: 4px 10px; border-bottom: 1px solid #ddd; text-align: right; }
td:first-child, th:first-child { text-align: left; }
.pass { color: #1a7f37; } .fail { color: #b42318; }
figure { margin: 1.5em 0; } pre { background: #f6f6f6; padding: 8px; overflow-x: auto; }
</style></head><body>
<h1>EdgeLoop closed loop</h1>
<p>{{ r.agents }} edge agents, {{ r.frames_per_phase }} frames per agent per phase,
drift <b>{{ r.drift }}</b>{% if r.quick %} (quick models){% endif %}.
Serving <b>{{ r.serving_version }}</b> before; after the last round:
{% for a, v in r.agents_on.items() -%}
{{ a }} on <b>{{ v }}</b>{% if not loop.last %}, {% endif %}
{%- endfor %}.
{% if rounds %}{% for e in rounds %}{{ 'Round' if loop.first else 'round' }} {{ e.round }}
{%- if e.after is defined %} (trigger to every agent on the new model) took
<b>{{ e.round_s }} s</b> (the job {{ e.job_wall_s }} s, {{ e.samples_new }} newly verified
samples (the job takes the newest), model <b>{{ e.job.version if e.job else "none" }}</b>
{%- if e.job and e.job.gate and not e.job.gate.passed %}, refused by the gate{% endif %})
{%- else %}: not run ({{ e.skipped }}){% endif %}; {% endfor %}
{%- else %}The round (trigger to every agent on the new model) took <b>{{ r.round_s }} s</b>
(the job {{ r.job_wall_s }} s); {% endif %}the whole run {{ r.wall_s }} s.</p>
<table id="headline">
<tr>{% for h in header %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in rows %}<tr>{% for c in row %}<td>{{ c }}</td>{% endfor %}</tr>
{% endfor %}</table>
<p>Every column is measured on the same evaluation frames, from source scans the
live phases never streamed; the serving student's columns apply the agents' routing
rule without sending. From the second round on, the drifted stream continues on the
live frames and each round trains on the newest verified samples (all from live
frames); every round's column but the last is measured without sending, so no
evaluation frame is ever verified.</p>
<h2>Goals</h2>
<ul>{% for name, ok, column in goals %}<li class="{{ 'pass' if ok else 'fail' }}">{{ name }}:
{{ 'met' if ok else 'not met' }}{% if column %} ({{ column }}){% endif %}</li>{% endfor %}</ul>
<h2>Over time</h2>
{% for name, svg in plots.items() %}<figure id="plot-{{ name }}">{{ svg }}</figure>
{% endfor %}
{% for title, text in jobs %}<h2>{{ title }}</h2>
<pre>{{ text }}</pre>
{% endfor %}
</body></html>
"""


def render_report(report: dict[str, Any]) -> str:
    """The report's HTML text."""
    env = Environment(autoescape=True)
    columns = report.get("goal_columns", {})
    goals = [
        (k, bool(v), columns.get(k, ""))
        for k, v in report.get("goals", {}).items()
        if isinstance(v, bool)
    ]
    rounds = report.get("rounds") or []
    if rounds:
        jobs = [
            (
                f"The distillation job, round {e['round']}",
                json.dumps(e.get("job"), indent=2, default=str),
            )
            for e in rounds
            if e.get("job") is not None
        ]
    else:
        jobs = [("The distillation job", json.dumps(report.get("job"), indent=2, default=str))]
    return env.from_string(_TEMPLATE).render(
        r=report,
        rounds=rounds,
        header=table_header(report),
        rows=table_rows(report),
        goals=goals,
        plots={k: Markup(v) for k, v in plots(report).items()},  # built here, values escaped
        jobs=jobs,
    )


def write_report(path: Path, report: dict[str, Any]) -> Path:
    """Write the report to ``path`` (folders made as needed) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(report), encoding="utf-8")
    return path
