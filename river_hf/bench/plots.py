"""Figures of a bench record: the speed/fidelity Pareto front and the exit-depth histogram per tau.

SVG by default: text, so the figures kept in docs/ are reviewable diffs and no binary enters git; a path ending in
.png gets a PNG. Matplotlib's object API with explicit canvases: no pyplot, so nothing global (a user's backend, open
figures) changes.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib import rc_context
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.backends.backend_svg import FigureCanvasSVG
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, PercentFormatter

from ..core.config import bits_label
from .systems import twin_label

COLORS = {"backbone": "black", "full-quant": "tab:red", "static-full-quant": "tab:orange", "river": "tab:blue",
          "random": "0.45", "defaults": "tab:green"}
MARKERS = {"backbone": "s", "full-quant": "D", "static-full-quant": "x", "river": "o", "random": "v",
           "defaults": "*"}
SIGNAL_COLORS = {"cosine": "tab:blue", "cosine_first": "tab:green", "update_norm": "tab:purple"}
STRATEGY_COLORS = {"river": "tab:blue", "recompute": "tab:orange", "state_propagation": "tab:green",
                   "mask": "tab:red", "mono_decreasing": "tab:purple"}


FIGURE_SUFFIX = ".svg"
# Fixed ids, no date and text kept as text: the same record always gives the same bytes (small, diffable files).
SVG_SETTINGS = {"svg.hashsalt": "river_hf", "svg.fonttype": "none"}


def write_plots(record: dict, json_path: str | Path) -> list[Path]:
    """The figures next to the JSON record: <name>-pareto.svg (or <name>-strategies.svg for a KV-strategy run) and
    <name>-exit-depths.svg."""
    stem = Path(json_path).with_suffix("")
    is_strategy_run = any(system["kind"] == "strategy" for system in record["systems"])
    first = ("strategies", strategy_figure) if is_strategy_run else ("pareto", pareto_figure)
    paths = [Path(f"{stem}-{first[0]}{FIGURE_SUFFIX}"), Path(f"{stem}-exit-depths{FIGURE_SUFFIX}")]
    save(first[1](record), paths[0])
    save(exit_depth_figure(record), paths[1])
    return paths


def save(figure: Figure, path: Path) -> None:
    """SVG unless the path ends in .png."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".png":
        FigureCanvasAgg(figure).print_png(str(path))
        return
    with rc_context(SVG_SETTINGS):
        FigureCanvasSVG(figure).print_svg(str(path), metadata={"Date": None})


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
    _random_curve(ax, systems)
    labelled = set()
    for system, (match, ratio) in zip(systems, points):
        kind, label = system["kind"], _legend_label(system)
        color = SIGNAL_COLORS.get(system.get("signal"), COLORS[kind]) if kind == "river" else COLORS[kind]
        ax.scatter(match, ratio, color=color, marker=MARKERS[kind], zorder=2, s=40,
                   label=None if label in labelled else label)
        labelled.add(label)
        if kind in ("river", "full-quant") or (kind == "defaults" and system["tau"] is not None):
            ax.annotate(f"τ={system['tau']:g}", (match, ratio), textcoords="offset points", xytext=(5, 4),
                        fontsize=7)
        elif kind == "random":
            ax.annotate(f"p={system['exit_rate']:g}", (match, ratio), textcoords="offset points", xytext=(5, -9),
                        fontsize=7, color=COLORS["random"])
    ax.axhline(1.0, color="0.85", linewidth=0.8, zorder=0)
    ax.set_xlabel("teacher-forced next-token match vs backbone")
    ax.set_ylabel("decode speed / backbone")
    ax.xaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    ax.legend(fontsize=8, loc="best")
    _title(figure, record, "speed vs fidelity")
    return figure


def _legend_label(system: dict) -> str:
    if system["kind"] == "river":
        return f"river ({system.get('signal') or 'cosine'})"
    return "random routing" if system["kind"] == "random" else system["kind"]


def _random_curve(ax, systems: list[dict]) -> None:
    """The blind-mixing baseline as a line from the backbone through the random-routing points, by speed."""
    points = sorted([(s["summary"]["speed_ratio"], s["fidelity"]["match"]) for s in systems if s["kind"] == "random"])
    if points:
        points = [(1.0, 1.0), *points]
        ax.plot([p[1] for p in points], [p[0] for p in points], color=COLORS["random"], linestyle="--",
                linewidth=1, zorder=1)


def strategy_figure(record: dict) -> Figure:
    """The paper's Fig. 3: per KV strategy and threshold, decode ms/token split into backbone layers, skipped-layer
    work (twins, K/V projections, placeholders) and the rest (embedding, LM head, sampling, Python), with the
    backbone's own time as a line; the mean exit depth and the match rate on each bar."""
    systems = [s for s in record["systems"] if s["kind"] == "strategy"]
    backbone = next(s for s in record["systems"] if s["kind"] == "backbone")
    figure = Figure(figsize=(max(6.0, 1.1 * len(systems) + 1.5), 4.8), dpi=110)
    ax = figure.add_subplot()
    xs = range(len(systems))
    parts = [(s["summary"]["backbone_ms_per_token"] or 0.0, s["summary"]["skipped_ms_per_token"] or 0.0,
              s["summary"]["ms_per_token"]) for s in systems]
    colors = [STRATEGY_COLORS.get(s["strategy"], "tab:gray") for s in systems]
    ax.bar(xs, [p[0] for p in parts], color=colors, label="backbone layers")
    ax.bar(xs, [p[1] for p in parts], bottom=[p[0] for p in parts], color=colors, alpha=0.45, hatch="//",
           label="skipped layers (twin / K-V work)")
    ax.bar(xs, [max(p[2] - p[0] - p[1], 0.0) for p in parts], bottom=[p[0] + p[1] for p in parts], color="0.85",
           label="rest (head, sampling, Python)")
    ax.axhline(backbone["summary"]["ms_per_token"], color="black", linestyle="--", linewidth=1,
               label=f"backbone {backbone['summary']['ms_per_token']:.1f} ms/token")
    for x, system, (_, _, total) in zip(xs, systems, parts):
        ax.annotate(f"depth {system['summary']['mean_exit_depth']:.1f}\n{system['fidelity']['match']:.0%}",
                    (x, total), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7)
    ax.set_xticks(list(xs), [f"{s['strategy']}\nτ={s['tau']:g}" for s in systems], fontsize=7)
    ax.set_ylabel("decode ms / token")
    ax.set_ylim(0, max(max(p[2] for p in parts), backbone["summary"]["ms_per_token"]) * 1.45)
    ax.legend(fontsize=7, loc="upper right", ncols=2)
    _title(figure, record, "KV strategies: where the decode time goes (label: mean exit depth, next-token match)")
    return figure


def exit_depth_figure(record: dict) -> Figure:
    """One panel per river system (full-quant first): the share of decoded positions at each exit depth."""
    rivers = [s for s in record["systems"] if s["summary"]["exit_depth_histogram"] is not None
              and s["kind"] != "random" and s.get("signal") in (None, "cosine")]
    num_layers = record["twins"]["num_layers"]
    figure = Figure(figsize=(7, 1.2 + 1.3 * max(len(rivers), 1)), dpi=110)
    axes = figure.subplots(max(len(rivers), 1), 1, sharex=True, squeeze=False)[:, 0]
    for ax, system in zip(axes, rivers):
        counts = {int(depth): n for depth, n in system["summary"]["exit_depth_histogram"].items()}
        total = sum(counts.values()) or 1
        depths = range(1, num_layers + 1)
        color = COLORS.get(system["kind"], STRATEGY_COLORS.get(system.get("strategy"), "tab:gray"))
        ax.bar(depths, [counts.get(d, 0) / total for d in depths], color=color, width=0.8)
        ax.set_ylim(0, 1)
        name = {"full-quant": "full-quant\n", "strategy": f"{system.get('strategy')}\n"}.get(system["kind"], "")
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


PRECISION_COLORS = ("tab:blue", "tab:red", "tab:green", "tab:purple", "tab:brown", "tab:olive")


def precisions_figure(records: list[dict]) -> Figure:
    """Several bench records (one twin precision each) on one speed-vs-match plane: per record, its cosine tau sweep
    (line), its full-quantization point (diamond) and its random-routing curve (dashed). Each record's ratios are to
    the backbone measured in its own run."""
    figure = Figure(figsize=(11, 5.5), dpi=110)
    ax = figure.add_subplot()
    for record, color in zip(records, PRECISION_COLORS):
        label = short_twin_label(record["twins"])
        rivers = sorted((s["fidelity"]["match"], s["summary"]["speed_ratio"], s["tau"]) for s in record["systems"]
                        if s["kind"] == "river" and s.get("signal") in (None, "cosine"))
        ax.plot([p[0] for p in rivers], [p[1] for p in rivers], marker="o", color=color, label=f"{label}: cosine τ")
        for match, ratio, tau in rivers:
            ax.annotate(f"{tau:g}", (match, ratio), textcoords="offset points", xytext=(4, 3), fontsize=6, color=color)
        randoms = sorted((s["summary"]["speed_ratio"], s["fidelity"]["match"]) for s in record["systems"]
                         if s["kind"] == "random")
        if randoms:
            points = [(1.0, 1.0), *randoms]
            ax.plot([p[1] for p in points], [p[0] for p in points], linestyle="--", marker="v", markersize=4,
                    color=color, alpha=0.6, label=f"{label}: random routing")
        full = next((s for s in record["systems"] if s["kind"] == "full-quant"), None)
        if full is not None:
            ax.scatter(full["fidelity"]["match"], full["summary"]["speed_ratio"], marker="D", s=50, color=color,
                       edgecolors="black", zorder=3, label=f"{label}: full quantization")
    ax.axhline(1.0, color="0.85", linewidth=0.8, zorder=0)
    ax.set_xlabel("teacher-forced next-token match vs backbone")
    ax.set_ylabel("decode speed / backbone (each run's own backbone)")
    ax.xaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # outside: the points stay visible
    model = records[0]["model"]["id"] if records else ""
    figure.suptitle(f"{model}: speed vs fidelity per twin precision", fontsize=9)
    figure.tight_layout()
    return figure


def short_twin_label(twins: dict) -> str:
    group = "row" if twins["group_size"] is None else f"g{twins['group_size']}"
    head = f" +{twins['lm_head_nbits']}b head" if twins.get("quantize_lm_head") else ""
    return f"{bits_label(twins['nbits'])}-bit {group}{head}"


SCALING_COLORS = ("tab:red", "tab:orange", "tab:green", "tab:blue", "tab:purple", "tab:brown", "0.45", "tab:olive",
                  "tab:cyan", "tab:pink", "black", "gold", "navy", "lime")


def scaling_figure(records: list[dict]) -> Figure:
    """Speed ratio (to each run's own backbone) against parameters, log x: one panel per machine capability, one
    solid line per system (by name, across `--random-model` records), and its byte-limit ratio dashed."""
    by_capability: dict[str, list[dict]] = {}
    for record in records:
        by_capability.setdefault(_machine(record), []).append(record)
    figure = Figure(figsize=(6.5 * len(by_capability), 4.8))
    axes = figure.subplots(1, len(by_capability), squeeze=False)[0]
    for ax, (machine, group) in zip(axes, sorted(by_capability.items())):
        group = sorted(group, key=_parameters)
        names = list(dict.fromkeys(plot_line(r, s) for r in group for s in r["systems"] if s["kind"] != "backbone"))
        for name, color in zip(names, SCALING_COLORS * (len(names) // len(SCALING_COLORS) + 1)):
            points = [(_parameters(r), s["summary"]) for r in group for s in r["systems"] if plot_line(r, s) == name]
            xs = [x for x, _ in points]
            ax.plot(xs, [sm["speed_ratio"] for _, sm in points], marker="o", color=color, label=name)
            limits = [sm.get("byte_ratio") for _, sm in points]
            if all(limit is not None for limit in limits):
                # marker: a panel with one model size still shows its byte limit
                ax.plot(xs, limits, linestyle="--", marker="_", markersize=12, color=color, alpha=0.7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("parameters (random-initialised Llama shapes)")
        ax.set_ylabel("decode speed vs backbone (solid: measured, dashed: byte limit)")
        ax.set_title(machine, fontsize=9)
        ax.legend(fontsize=7)
    figure.suptitle("speed-up vs model size; byte limit = backbone's weight bytes per token over the system's",
                    fontsize=9)
    figure.tight_layout()
    return figure


def plot_line(record: dict, system: dict) -> str:
    """The line a system belongs to: its name; random routing's also names the twins it exits onto (the last build
    of its record), since records of other twin builds route randomly too."""
    builds = list((record.get("random_model") or {}).get("twin_builds") or [])
    return f"{system['name']} ({builds[-1]} twins)" if system["kind"] == "random" and builds else system["name"]


def _parameters(record: dict) -> float:
    model = record.get("random_model") or {}
    return float(model.get("parameters") or record["memory"]["backbone_weight_bytes"] / 2)  # bf16: 2 bytes each


def _machine(record: dict) -> str:
    """A panel per machine kind: CPU model, torch's dispatch and, where the record lists the CPU's flags, whether it
    has AMX (an Intel Xeon with AMX and one without share model name and dispatch, "AVX512", not kernel speed)."""
    env = record["environment"]
    features = env.get("cpu_features")
    amx = "" if not features else (", AMX" if any(f.startswith("amx") for f in features) else ", no AMX")
    return (f"{env.get('cpu_model') or 'unknown CPU'}: {env.get('cpu_capability') or '?'}{amx}, "
            f"{env.get('torch_threads')} threads")
