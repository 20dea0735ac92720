"""The closed loop's figures drawn: the headline table, the goals, and a bar chart.

    header, rows = table_header(report), table_rows(report)   # report: run_closed_loop's

The table has a column per phase the fleet was measured in: ``before drift``,
``drifted`` and ``after round k`` for each round that ran (the last marked steady
state when there are several). The first round's goals read ``after round 1``, the
steady-state goals the last round (``goal_columns``).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = [
    "goal_columns",
    "goals",
    "print_table",
    "table_header",
    "table_rows",
    "write_svg",
]


def _rounds(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The rounds that were measured (each with ``after`` and ``after_clean``)."""
    done = [e for e in r.get("rounds") or [] if "after" in e]
    if done:
        return done
    return [{"round": 1, "after": r["after"], "after_clean": r["after_clean"]}]


def _column(entry: dict[str, Any], count: int) -> str:
    name = f"after round {entry['round']}"
    return f"{name} (steady state)" if count > 1 and entry["round"] == count else name


# Which column each goal reads: the first round's goals from round 1, the steady-state
# goals from the last round.
_FIRST_ROUND_GOALS = (
    "drifted_acc_ge_90pct_of_pre",
    "half_gap_closed",
    "gap_closed_share",
    "forgetting_le_2pt",
    "forward_rate_down_30pct",
)
_STEADY_GOALS = ("hybrid_ge_99pct_teacher", "forward_le_25pct", "uplink_le_10pct")


def goal_columns(r: dict[str, Any]) -> dict[str, str]:
    """The table column each goal reads."""
    rounds = _rounds(r)
    first, last = _column(rounds[0], len(rounds)), _column(rounds[-1], len(rounds))
    return {
        **{name: first for name in _FIRST_ROUND_GOALS},
        **{name: last for name in _STEADY_GOALS},
    }


def goals(r: dict[str, Any]) -> dict[str, Any]:
    """Each goal met or not (and the share of the drift's gap the first round closed)."""
    rounds = _rounds(r)
    first, last = rounds[0], rounds[-1]
    pre, drifted, after = (
        r["before"]["edge_accuracy"],
        r["drifted"]["edge_accuracy"],
        first["after"]["edge_accuracy"],
    )
    gap = pre - drifted
    steady = last["after"]
    return {
        "drifted_acc_ge_90pct_of_pre": after >= 0.9 * pre,
        "half_gap_closed": gap <= 0 or (after - drifted) >= 0.5 * gap,
        "gap_closed_share": None if gap <= 0 else round((after - drifted) / gap, 3),
        "forgetting_le_2pt": pre - first["after_clean"]["edge_accuracy"] <= 0.02,
        "forward_rate_down_30pct": first["after"]["forward_rate"]
        <= 0.7 * r["drifted"]["forward_rate"],
        "hybrid_ge_99pct_teacher": steady["hybrid_accuracy"]
        >= 0.99 * steady["teacher_only_accuracy"],
        "forward_le_25pct": steady["forward_rate"] <= 0.25,
        "uplink_le_10pct": steady["uplink_share"] <= 0.10,
    }


def table_header(r: dict[str, Any]) -> list[str]:
    """The headline table's column names."""
    rounds = _rounds(r)
    return ["", "before drift", "drifted", *(_column(e, len(rounds)) for e in rounds)]


def table_rows(r: dict[str, Any]) -> list[tuple[str, ...]]:
    """The headline table: (figure, before drift, drifted, after round 1, ..., after round N)."""
    rounds = _rounds(r)

    def pct(v: float) -> str:
        return f"{100 * v:.1f}%"

    def row(label: str, key: str) -> tuple[str, ...]:
        return (
            label,
            pct(r["before"][key]),
            pct(r["drifted"][key]),
            *(pct(e["after"][key]) for e in rounds),
        )

    return [
        (
            "edge acc, drifted stream",
            "-",
            pct(r["drifted"]["edge_accuracy"]),
            *(pct(e["after"]["edge_accuracy"]) for e in rounds),
        ),
        (
            "edge acc, clean stream",
            pct(r["before"]["edge_accuracy"]),
            "-",
            *(pct(e["after_clean"]["edge_accuracy"]) for e in rounds),
        ),
        row("forward rate", "forward_rate"),
        row("hybrid accuracy", "hybrid_accuracy"),
        row("teacher-only accuracy", "teacher_only_accuracy"),
        row("uplink vs every frame", "uplink_share"),
    ]


def print_table(console: Console, r: dict[str, Any]) -> None:
    """The headline table, each round's timing and the goals, on ``console``."""
    table = Table(title=f"closed loop: {r['agents']} agents, drift {r['drift']}")
    header = table_header(r)
    table.add_column(header[0])
    for col in header[1:]:
        table.add_column(col, justify="right")
    for row in table_rows(r):
        table.add_row(*row)
    console.print(table)
    for e in r.get("rounds") or []:
        if "after" not in e:
            console.print(f"round {e['round']}: not run ({e.get('skipped')})")
            continue
        version = e["job"]["version"] if e.get("job") else None
        console.print(
            f"round {e['round']} (trigger -> job -> agents): {e['round_s']} s"
            f" (job {e['job_wall_s']} s; with its streams {e['round_wall_s']} s),"
            f" {e.get('samples_new')} newly verified samples, model {version}"
        )
    console.print(f"whole run {r['wall_s']} s")
    columns = r.get("goal_columns", {})
    console.print(
        "goals: "
        + ", ".join(
            f"{k}={v} [{columns[k]}]" if k in columns else f"{k}={v}" for k, v in r["goals"].items()
        ),
        highlight=False,
    )


def write_svg(path: Path, r: dict[str, Any]) -> None:
    """A small bar chart (edge accuracy and forward rate per column), no plotting library."""
    bars: list[tuple[str, float, float | None, str]] = [
        ("clean, before", r["before"]["edge_accuracy"], r["before"]["forward_rate"], ""),
        ("drifted", r["drifted"]["edge_accuracy"], r["drifted"]["forward_rate"], ""),
    ]
    for e in _rounds(r):
        version = str((e.get("job") or {}).get("version") or "")
        served = sorted(set((e.get("agents_on") or {}).values()))
        marker = ", ".join(served) if served else version
        k = e["round"]
        bars.append(
            (f"round {k}, drifted", e["after"]["edge_accuracy"], e["after"]["forward_rate"], marker)
        )
        bars.append((f"round {k}, clean", e["after_clean"]["edge_accuracy"], None, marker))
    step = 125
    w, h, base = max(560, 60 + step * len(bars)), 320, 250
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}"'
        ' font-family="sans-serif" font-size="12">',
        f'<text x="10" y="18" font-size="14">EdgeLoop closed loop: drift {r["drift"]}</text>',
        f'<line x1="40" y1="{base}" x2="{w - 10}" y2="{base}" stroke="#333"/>',
    ]
    for i, (label, acc, fwd, version) in enumerate(bars):
        x = 60 + i * step
        ah = acc * 200
        parts.append(
            f'<rect x="{x}" y="{base - ah:.1f}" width="40" height="{ah:.1f}" fill="#3b7dd8"/>'
        )
        parts.append(f'<text x="{x}" y="{base - ah - 4:.1f}">{100 * acc:.1f}%</text>')
        if fwd is not None:
            fh = fwd * 200
            parts.append(
                f'<rect x="{x + 45}" y="{base - fh:.1f}" width="40" height="{fh:.1f}"'
                ' fill="#e07b39"/>'
            )
            parts.append(f'<text x="{x + 45}" y="{base - fh - 4:.1f}">{100 * fwd:.0f}%</text>')
        parts.append(f'<text x="{x}" y="{base + 16}">{html.escape(label)}</text>')
        if version:
            parts.append(
                f'<text class="version-marker" data-version="{html.escape(version)}"'
                f' x="{x}" y="{base + 32}" fill="#6a3d9a">model {html.escape(version)}</text>'
            )
    lx = w - 180
    parts.append(
        f'<rect x="{lx}" y="30" width="10" height="10" fill="#3b7dd8"/>'
        f'<text x="{lx + 15}" y="39">edge accuracy</text>'
    )
    parts.append(
        f'<rect x="{lx}" y="46" width="10" height="10" fill="#e07b39"/>'
        f'<text x="{lx + 15}" y="55">forward rate</text>'
    )
    parts.append("</svg>")
    path.write_text("\n".join(parts))
