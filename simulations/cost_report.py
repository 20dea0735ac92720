"""The cost model drawn: the three-way table per stream, the threshold sweep, the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["plot_sweep", "print_cost"]


def plot_sweep(
    path: Path,
    sweeps: dict[str, list[dict[str, Any]]],
    costs: dict[str, float],
    title: str,
) -> Path:
    """Accuracy, forwarded share and cost against the threshold, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_share, ax_trade) = plt.subplots(1, 3, figsize=(16, 4.8))
    ax_cost = ax_share.twinx()
    colours = ["#3b7dd8", "#d8513b", "#2e9e5b", "#8a4fd8"]
    for colour, (name, rows) in zip(colours, sweeps.items(), strict=False):
        ts = [r["threshold"] for r in rows]
        acc = [100 * r["hybrid_accuracy"] for r in rows]
        share = [100 * r["forwarded_share"] for r in rows]
        usd = [r["usd_per_camera_h"] * 1000 for r in rows]
        ax_acc.plot(ts, acc, "-o", color=colour, label=f"hybrid, {name}")
        ax_acc.axhline(
            100 * rows[0]["edge_accuracy"], color=colour, ls=":", lw=1, label=f"edge-only, {name}"
        )
        ax_acc.axhline(
            100 * rows[0]["teacher_accuracy"],
            color=colour,
            ls="--",
            lw=1,
            label=f"cloud-only, {name}",
        )
        ax_share.plot(ts, share, "-o", color=colour, label=f"forwarded, {name}")
        ax_cost.plot(ts, usd, "--", color=colour, alpha=0.6)
        ax_trade.plot(usd, acc, "-o", color=colour, label=f"hybrid, {name}")
        for t, x, y in zip(ts, usd, acc, strict=True):
            if t in (0.3, 0.5, 0.6, 0.7, 0.9):
                ax_trade.annotate(
                    f"t={t:g}", (x, y), fontsize=7, textcoords="offset points", xytext=(4, -10)
                )
    ax_trade.axvline(costs["edge-only"] * 1000, color="grey", ls=":", label="edge-only cost")
    ax_trade.axvline(costs["cloud-only"] * 1000, color="black", ls="--", label="cloud-only cost")
    ax_acc.set_xlabel("confidence threshold (forward below it)")
    ax_acc.set_ylabel("top-1 accuracy (%)")
    ax_acc.legend(fontsize=7)
    ax_share.set_xlabel("confidence threshold")
    ax_share.set_ylabel("frames forwarded (%), solid")
    ax_cost.set_ylabel("USD per 1,000 camera-hours, dashed")
    ax_share.legend(fontsize=7, loc="upper left")
    ax_trade.set_xlabel("USD per 1,000 camera-hours (edge + cloud + transfer)")
    ax_trade.set_ylabel("top-1 accuracy (%)")
    ax_trade.legend(fontsize=7, loc="lower right")
    for ax in (ax_acc, ax_share, ax_trade):
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_cost(report: dict[str, Any], console: Console) -> None:
    """The three-way table per stream, the sweep, and the inputs with their sources."""
    for name, rows in report["tables"].items():
        table = Table(title=f"processing location, {name} stream (per camera-hour)")
        for head in (
            "location", "answer p50 ms", "answer p99 ms", "verified share",
            "verified p50 ms", "verified p99 ms", "accuracy", "edge $", "cloud $",
            "transfer $", "total $/cam-h", "uplink MB/cam-h",
        ):  # fmt: skip
            table.add_column(head, justify="right")
        for r in rows:

            def ms(v: float | None) -> str:
                return "-" if v is None else f"{v:.1f}"

            table.add_row(
                r["location"],
                ms(r["answer_p50_ms"]),
                ms(r["answer_p99_ms"]),
                f"{100 * r['verified_share']:.1f}%",
                ms(r["verified_p50_ms"]),
                ms(r["verified_p99_ms"]),
                f"{100 * r['accuracy']:.2f}%",
                f"{r['edge_usd']:.5f}",
                f"{r['cloud_compute_usd']:.5f}",
                f"{r['transfer_usd']:.5f}",
                f"{r['usd_per_camera_h']:.5f}",
                f"{r['uplink_gb'] * 1000:.1f}",
            )
        console.print(table)
    for name, rows in report["sweeps"].items():
        table = Table(title=f"threshold sweep, {name} stream")
        for head in ("threshold", "forwarded", "hybrid accuracy", "$/camera-h"):
            table.add_column(head, justify="right")
        for r in rows:
            table.add_row(
                f"{r['threshold']:g}",
                f"{100 * r['forwarded_share']:.1f}%",
                f"{100 * r['hybrid_accuracy']:.2f}%",
                f"{r['usd_per_camera_h']:.5f}",
            )
        console.print(table)
    console.print("[bold]measured inputs[/]")
    m = report["measured"]
    for key, source in m["sources"].items():
        console.print(f"  {key} = {m[key]}  ({source})", highlight=False)
    console.print("[bold]stated prices and assumptions[/]")
    for row in report["prices"]:
        console.print(f"  {row['name']} = {row['value']}  ({row['source']})", highlight=False)
    if "plot" in report:
        console.print(f"plot: {report['plot']}")
