"""What a bench record says, for people: the markdown tables (`river-hf bench`, `--strategies`), the full-quant
target, and the comparison of each exit signal with random routing at equal speed or equal exit depth.
"""

from __future__ import annotations

from .bytes import byte_limit_lines
from .systems import CAPTURED, FULL_QUANT, STATIC_FULL_QUANT, twin_label

# The paper's premise: full quantization through the river should run close to a model that simply is quantized.
FULL_QUANT_TARGET = 0.9


def full_quant_target(systems: list[dict]) -> dict | None:
    by_name = {system["name"]: system for system in systems}
    if FULL_QUANT not in by_name or STATIC_FULL_QUANT not in by_name:
        return None
    ratio = by_name[FULL_QUANT]["summary"]["ratio_vs_static_full_quant"]
    return {"full_quant_vs_static_full_quant": ratio, "target": FULL_QUANT_TARGET, "met": ratio >= FULL_QUANT_TARGET}


# ---- the tables --------------------------------------------------------------------------------------------------
def markdown_table(record: dict) -> str:
    """The twin configuration and the settings, then one row per system (and the comparisons that apply)."""
    s, twins, env = record["settings"], record["twins"], record["environment"]
    machine = f"{env.get('cpu_capability') or 'unknown'} CPU capability, {env['torch_threads']} threads"
    fidelity = (f"fidelity: teacher-forced, {s['fidelity_prompts']} prompts x {s['fidelity_tokens']} backbone tokens"
                if isinstance(record.get("fidelity", {}), dict) else f"fidelity {record['fidelity']}")
    lines = [twin_label(twins) + f" · model {record['model']['id']} on {record['model']['device']} · {machine}",
             f"speed: {s['prompts']} prompts x {s['rounds']} rounds, {s['max_new_tokens']} new tokens, batch 1, "
             f"interleaved after warm-up, median; {fidelity}", "",
             f"| system | decode tok/s | vs backbone | vs compiled backbone | byte limit | share of limit | vs static "
             f"full-quant | prefill ms | mean exit depth (of {twins['num_layers']}) | next-token match | KL |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for system in record["systems"]:
        sm, fid = system["summary"], system["fidelity"]
        depth = f"{sm['mean_exit_depth']:.1f}" + ("" if sm["exit_depth_measured"] else " (fixed)")
        match = "n/a" if fid["match"] is None else f"{fid['match']:.1%}"
        kl = "n/a" if fid["kl"] is None else f"{fid['kl']:.4f}"
        lines.append(f"| {system_label(system)} | {sm['decode_tokens_per_s']:.1f} | {sm['speed_ratio']:.2f}x | "
                     f"{_ratio(sm.get('ratio_vs_compiled_backbone'))} | {_ratio(sm.get('byte_ratio'))} | "
                     f"{_share(sm.get('share_of_byte_limit'))} | "
                     f"{_ratio(sm['ratio_vs_static_full_quant'])} | {sm['prefill_ms']:.0f} | {depth} | {match} | "
                     f"{kl} |")
    limits = byte_limit_lines(record["systems"])
    if limits:
        lines += ["", "how far from the byte limit (weight bytes a decoded token reads; the backbone's over the "
                      "system's is the speed-up a purely memory-bound decode could reach):", *limits]
    lines += step_split_table(record["systems"])
    target = record.get("target")
    if target:
        met = "met" if target["met"] else "NOT met"
        lines += ["", f"full-quant (river, tau=-1) runs at {target['full_quant_vs_static_full_quant']:.2f}x the "
                      f"static full-quant model (target >= {target['target']}x: {met})"]
    for key, what in (("versus_random", "speed"), ("versus_random_at_equal_depth", "mean exit depth")):
        lines += _versus_random_lines(record.get(key), what)
    return "\n".join(lines)


def step_split_table(systems: list[dict]) -> list[str]:
    """Where a decode step goes, ms per token (one hooked generate call per system; see bench/step_split.py)."""
    splits = [(system, system["summary"].get("step_split_ms_per_token")) for system in systems]
    if not any(split for _, split in splits):
        return []
    lines = ["", "where a decode step goes, ms per token (one extra generate call per system with clock hooks, which "
                 "add a little to every part):", "",
             "| system | matmuls in layers | rest of layers | routing | outside layers | total |",
             "|---|---:|---:|---:|---:|---:|"]
    for system, split in splits:
        if split:
            lines.append(f"| {system_label(system)} | {split['matmuls']:.1f} | {split['rest_of_layers']:.1f} | "
                         f"{split['routing']:.1f} | {split['outside_layers']:.1f} | {split['total']:.1f} |")
    return lines


def _versus_random_lines(comparison: dict | None, what: str) -> list[str]:
    if not comparison:
        return []
    lines = ["", f"against random routing at equal {what} (match of the system minus the random curve's, "
                 f"interpolated at the system's {what}):"]
    lines += [f"- {name}: {_points(entry['delta'])} ({entry['beats']} of {entry['points']} comparable points "
              f"above the curve" + ("" if entry["mean_delta"] is None else f"; mean {_points(entry['mean_delta'])}")
              + _dominance(entry.get("dominates_fastest_random")) + ")" for name, entry in comparison.items()]
    return lines


def _dominance(margins: list[float] | None) -> str:
    if not margins:
        return ""
    return (f"; {len(margins)} point(s) beyond the curve are also more faithful than its fastest point, by "
            + ", ".join(f"{m * 100:+.1f} pp" for m in margins))


def strategy_table(record: dict) -> str:
    """The paper's Fig. 3 as a table: per KV strategy and tau, where the decode time goes, and what it costs."""
    twins = record["twins"]
    lines = [f"| strategy | tau | mean exit depth (of {twins['num_layers']}) | backbone ms/token | skipped-layer "
             f"ms/token | total ms/token | vs backbone | next-token match | KL |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for system in record["systems"]:
        sm, fid = system["summary"], system["fidelity"]
        strategy = system["strategy"] or system["kind"]
        tau = "" if system["tau"] is None else f"{system['tau']:g}"
        lines.append(f"| {strategy} | {tau} | {sm['mean_exit_depth']:.1f} | {_ms(sm['backbone_ms_per_token'])} | "
                     f"{_ms(sm['skipped_ms_per_token'])} | {sm['ms_per_token']:.1f} | {sm['speed_ratio']:.2f}x | "
                     f"{fid['match']:.1%} | {fid['kl']:.4f} |")
    return "\n".join(lines)


def versus_random(systems: list[dict], axis: str = "speed") -> dict[str, dict]:
    """Per exit signal: how much more faithful than random routing it is at the same speed (axis="speed"), or at the
    same mean exit depth (axis="depth": the same share of backbone layers, router overhead aside).

    The random curve is (x, match) of the random-routing systems plus the backbone (1.0x / full depth, 100%),
    linearly interpolated. A system beyond the curve's fast end has no random system to compare with (random routing
    exits at a uniformly drawn depth, so even p=1 keeps about half the layers on the backbone): its delta is None
    and it is counted as `out_of_range`, not guessed."""
    def x_of(system):  # oriented so that the backbone is the curve's slow end (smallest x)
        return system["summary"]["speed_ratio"] if axis == "speed" else -system["summary"]["mean_exit_depth"]

    backbone = next((s for s in systems if s["kind"] == "backbone"), None)
    curve = sorted([(x_of(s), s["fidelity"]["match"]) for s in systems if s["kind"] == "random"]
                   + ([(x_of(backbone), 1.0)] if backbone is not None else []))
    if len(curve) < 2:
        return {}
    by_signal: dict[str, list[float | None]] = {}
    dominating: dict[str, list[float]] = {}
    for system in systems:
        if system["kind"] in ("river", "strategy") and system.get("signal"):
            x, match = x_of(system), system["fidelity"]["match"]
            random_match = _interpolate(curve, x)
            delta = None if random_match is None else match - random_match
            system["fidelity"][f"match_minus_random_at_equal_{axis}"] = delta
            label = system["signal"] if system["kind"] == "river" else f"{system['strategy']} ({system['signal']})"
            by_signal.setdefault(label, []).append(delta)
            if random_match is None and match > curve[-1][1]:  # beyond the curve AND more faithful than its end
                dominating.setdefault(label, []).append(match - curve[-1][1])
    return {label: {**_comparison(deltas), "dominates_fastest_random": dominating.get(label, [])}
            for label, deltas in by_signal.items()}


def _comparison(deltas: list[float | None]) -> dict:
    compared = [d for d in deltas if d is not None]
    return {"delta": deltas, "points": len(compared), "beats": sum(d > 0 for d in compared),
            "out_of_range": len(deltas) - len(compared),
            "mean_delta": sum(compared) / len(compared) if compared else None}


def _interpolate(curve: list[tuple[float, float]], x: float) -> float | None:
    """The curve's match at speed x; below its slowest point, its slowest point's; None beyond its fastest."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else max(y0, y1)
    return None


def _points(values) -> str:
    if isinstance(values, list):
        return ", ".join(_points(v) for v in values)
    return "faster than any random point" if values is None else f"{values * 100:+.1f} pp"


def _ratio(value) -> str:
    return "" if value is None else f"{value:.2f}x"


def _share(value) -> str:
    return "" if value is None else f"{value:.0%}"


def _ms(value) -> str:
    return "" if value is None else f"{value:.1f}"


SYSTEM_LABELS = {"backbone": "backbone", "full-quant": "full-quant (river tau=-1)",
                 "static-full-quant": "static full-quant (no router)"}


def system_label(system: dict) -> str:
    if system["name"].endswith(CAPTURED):  # its own row beside the eager system of the same kind
        return system["name"]
    if system["kind"] in SYSTEM_LABELS:  # a named variant (--random-model: "static 4-bit+head") keeps its name
        return SYSTEM_LABELS[system["kind"]] if system["name"] == system["kind"] else system["name"]
    if system["kind"] == "random":
        return f"random routing p={system['exit_rate']:g}"
    if system["kind"] == "defaults":
        return system["name"]
    if system["kind"] == "strategy":
        return f"{system['strategy']} tau={system['tau']:g}"
    signal = "" if system.get("signal") in (None, "cosine") else f" ({system['signal']})"
    return f"river tau={system['tau']:g}{signal}"
