"""PNG figures of a bench record: the speed/fidelity Pareto front and the exit-depth histogram per tau.

Matplotlib's object API with the Agg canvas: no pyplot, so nothing global (a user's backend, open figures) changes.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, PercentFormatter

from .systems import twin_label

COLORS = {"backbone": "black", "full-quant": "tab:red", "static-full-quant": "tab:orange", "river": "tab:blue"}
MARKERS = {"backbone": "s", "full-quant": "D", "static-full-quant": "x", "river": "o"}


def write_plots(record: dict, json_path: str | Path) -> list[Path]:
    """Both figures next to the JSON record: <name>-pareto.png and <name>-exit-depths.png."""
    stem = Path(json_path).with_suffix("")
    paths = [Path(f"{stem}-pareto.png"), Path(f"{stem}-exit-depths.png")]
    save(pareto_figure(record), paths[0])
    save(exit_depth_figure(record), paths[1])
    return paths


def save(figure: Figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure).print_png(str(path))


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points (match, speed ratio) no other point beats on both, by increasing match."""
    front = [p for p in points if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in points)]
    return sorted(set(front))


def pareto_figure(record: dict) -> Figure:
    figure = Figure(figsize=(7, 5), dpi=110)
    ax = figure.add_subplot()
    systems = record["systems"]
    points = [(s["fidelity"]["match"], s["summary"]["speed_ratio"]) for s in systems]
    front = pareto_front(points)
    ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="0.7", zorder=1, label="Pareto front")
    for system, (match, ratio) in zip(systems, points):
        kind = system["kind"]
        ax.scatter(match, ratio, color=COLORS[kind], marker=MARKERS[kind], zorder=2, s=40,
                   label=kind if kind != "river" or system is _first_river(systems) else None)
        if kind in ("river", "full-quant"):
            ax.annotate(f"τ={system['tau']:g}", (match, ratio), textcoords="offset points", xytext=(5, 4),
                        fontsize=8)
    ax.axhline(1.0, color="0.85", linewidth=0.8, zorder=0)
    ax.set_xlabel("teacher-forced next-token match vs backbone")
    ax.set_ylabel("decode speed / backbone")
    ax.xaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    ax.legend(fontsize=8, loc="best")
    _title(figure, record, "speed vs fidelity")
    return figure


def _first_river(systems: list[dict]):
    return next((s for s in systems if s["kind"] == "river"), None)


def exit_depth_figure(record: dict) -> Figure:
    """One panel per river system (full-quant first): the share of decoded positions at each exit depth."""
    rivers = [s for s in record["systems"] if s["summary"]["exit_depth_histogram"] is not None]
    num_layers = record["twins"]["num_layers"]
    figure = Figure(figsize=(7, 1.2 + 1.3 * max(len(rivers), 1)), dpi=110)
    axes = figure.subplots(max(len(rivers), 1), 1, sharex=True, squeeze=False)[:, 0]
    for ax, system in zip(axes, rivers):
        counts = {int(depth): n for depth, n in system["summary"]["exit_depth_histogram"].items()}
        total = sum(counts.values()) or 1
        depths = range(1, num_layers + 1)
        ax.bar(depths, [counts.get(d, 0) / total for d in depths], color=COLORS[system["kind"]], width=0.8)
        ax.set_ylim(0, 1)
        name = "full-quant\n" if system["kind"] == "full-quant" else ""
        ax.set_ylabel(f"{name}τ={system['tau']:g}\nmean {system['summary']['mean_exit_depth']:.1f}", rotation=0,
                      ha="right", va="center", fontsize=8)
        ax.set_xlim(0.3, num_layers + 0.7)
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1].set_xlabel(f"exit depth: backbone layers run (of {num_layers}; {num_layers} = never exited)")
    _title(figure, record, "share of decoded tokens per exit depth")
    return figure


def _title(figure: Figure, record: dict, what: str) -> None:
    s = record["settings"]
    figure.suptitle(f"{record['model']['id']}: {what}\n{twin_label(record['twins'])}\n"
                    f"{s['prompts']} prompts x {s['rounds']} rounds x {s['max_new_tokens']} tokens (speed), "
                    f"{s['fidelity_prompts']} x {s['fidelity_tokens']} (fidelity)", fontsize=8)
    figure.tight_layout()
