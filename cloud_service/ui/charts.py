"""Line charts as inline SVG, drawn on the server (no chart library, nothing external)."""

from __future__ import annotations

from html import escape

__all__ = ["line_chart"]

PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563")


def line_chart(
    series: dict[str, dict[str, float]],
    *,
    title: str,
    unit: str = "",
    y_max: float | None = None,
    width: int = 560,
    height: int = 220,
) -> str:
    """One line per series name over the union of their (sorted) x keys."""
    xs = sorted({x for points in series.values() for x in points})
    left, right, top, bottom = 52, 44, 28, 36
    plot_w, plot_h = width - left - right, height - top - bottom
    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="{escape(title)}">',
        f'<text x="{left}" y="16" class="chart-title">{escape(title)}</text>',
    ]
    if not xs:
        parts.append(f'<text x="{left}" y="{top + plot_h / 2}" class="chart-empty">no data</text>')
        parts.append("</svg>")
        return "".join(parts)
    values = [v for points in series.values() for v in points.values()]
    top_value = y_max if y_max is not None else max(values) or 1.0
    top_value = top_value * (1.0 if y_max is not None else 1.1)

    def px(i: int) -> float:
        return left + (plot_w * i / max(1, len(xs) - 1))

    def py(value: float) -> float:
        return top + plot_h - plot_h * min(value, top_value) / top_value

    for k in range(5):
        value = top_value * k / 4
        y = py(value)
        parts.append(
            f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
        )
        parts.append(
            f'<text x="{left - 4}" y="{y + 4:.1f}" class="axis" text-anchor="end">'
            f"{value:.3g}{escape(unit)}</text>"
        )
    for i in sorted({0, len(xs) // 2, len(xs) - 1}):
        parts.append(
            f'<text x="{px(i):.1f}" y="{height - 18}" class="axis" text-anchor="middle">'
            f"{escape(xs[i][5:])}</text>"
        )
    for n, (name, points) in enumerate(sorted(series.items())):
        colour = PALETTE[n % len(PALETTE)]
        coords = [f"{px(i):.1f},{py(points[x]):.1f}" for i, x in enumerate(xs) if x in points]
        parts.append(
            f'<polyline fill="none" stroke="{colour}" stroke-width="2" '
            f'points="{" ".join(coords)}"/>'
        )
        if len(coords) == 1:
            cx, cy = coords[0].split(",")
            parts.append(f'<circle cx="{cx}" cy="{cy}" r="3" fill="{colour}"/>')
        parts.append(
            f'<text x="{left + 8 + 110 * n}" y="{height - 4}" class="legend" fill="{colour}">'
            f"&#9632; {escape(name)}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)
