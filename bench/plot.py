#!/usr/bin/env python3
"""PNG figures from benchmark JSON (matplotlib).

    python3 bench/plot.py FILE.json [FILE.json ...] [--out DIR] [--dpi N] [--mode dense pool ...]

Each file is recognised by its rows:

- `gdn bench --copy-kernel --json` (rows: model, state, layout, mode, T, B, us, copy_us, ...):
  one figure per model and addressing mode, `copy-<model>-<mode>.png`: gdn's speed as a
  percentage of the same-bytes copy kernel's (100 * copy_us / us: 100% = as fast as a kernel
  that only moves the call's state bytes) against B, one panel per state dtype, one line per T,
  VK solid and KV dashed. Rows with the state updated and no intermediate cache (the copy kernel
  is timed for those only).
- `bench/fla_compare.py --json` (rows: state, T, B, gdn_us and one <peer>_us per peer):
  `vs-<peer>.png`, the peer's time over gdn's (> 1: gdn is faster) against B, one panel per
  state dtype, one line per T; gdn writing out of place (gdn_oop_us, the peer's traffic) dotted.
  Its decode rows only (`--op decode`); with rows of several models, `vs-<peer>-<model>.png`.
- `gdn drift --json` (tool: "gdn drift"): `drift.png`, the relative error of o (mean over the
  calls between samples) and of the state against the exact (float64) trajectory, against
  accepted tokens, log-log: one column per mode (T = 1 decode, speculative verify), one line
  per state variant, stochastic rounding dashed.

Figure names do not carry the commit (docs link them by name; the title says which run), so
give one file of each kind per call or a separate --out for each.
"""

import argparse
import io
import json
import os
import sys

import matplotlib
from PIL import Image  # a dependency of matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

STATE_ORDER = ["fp32", "bf16", "fp16"]
NOT_PEERS = {"gdn_us", "gdn_oop_us", "floor_us"}


def _states(rows):
    present = {r["state"] for r in rows}
    return [s for s in STATE_ORDER if s in present] + sorted(present - set(STATE_ORDER))


def _t_colors(ts):
    cmap = plt.get_cmap("viridis")
    ts = sorted(ts)
    return {t: cmap(i / max(1, len(ts) - 1) * 0.9) for i, t in enumerate(ts)}


def _b_axis(ax, bs):
    ax.set_xscale("log", base=2)
    ax.set_xticks(bs)
    ax.set_xticklabels([str(b) for b in bs])
    ax.minorticks_off()
    ax.set_xlabel("B (rows per call)")
    ax.grid(True, alpha=0.3)


def _save(fig, out, name, dpi):
    path = os.path.join(out, name)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    # Line art on a 128-colour palette: a quarter of the bytes, no visible change (docs/img is in git).
    Image.open(buf).convert("RGB").quantize(128).save(path, optimize=True)
    print(path)
    return path


def kind(doc):
    if doc.get("tool") == "gdn drift":
        return "drift"
    rows = doc.get("rows") or []
    if rows and all("model" in r and "us" in r for r in rows):
        return "bench"
    peers = _decode_rows(rows)
    if peers and all("gdn_us" in r for r in peers):
        return "peers"
    return None


def _decode_rows(rows):
    # fla_compare --op fused rows (decode_us, chain_us, fused_us: one gdn call against a chain) get
    # no figure here; rows written before --op existed have no "op"
    return [r for r in rows if r.get("op", "decode") == "decode"]


def plot_bench(doc, out, dpi, modes=None):
    """gdn bench JSON -> copy-<model>-<mode>.png (every mode, or those named); returns the paths."""
    rows = [r for r in doc["rows"] if r.get("update", True) and not r.get("cache") and r.get("copy_us")
            and (not modes or r["mode"] in modes)]
    if not rows:
        raise ValueError("no rows with copy_us (run `gdn bench --copy-kernel`)")
    paths = []
    for model in sorted({r["model"] for r in rows}):
        for mode in sorted({r["mode"] for r in rows if r["model"] == model}):
            sel = [r for r in rows if r["model"] == model and r["mode"] == mode]
            states = _states(sel)
            colors = _t_colors({r["T"] for r in sel})
            bs = sorted({r["B"] for r in sel})
            fig, axes = plt.subplots(1, len(states), figsize=(4.6 * len(states), 3.9), sharey=True,
                                     squeeze=False)
            top = 100
            for ax, state in zip(axes[0], states):
                for layout, style, marker in (("VK", "-", "o"), ("KV", "--", "s")):
                    for t in sorted(colors):
                        pts = sorted((r["B"], 100 * r["copy_us"] / r["us"]) for r in sel
                                     if r["state"] == state and r["layout"] == layout and r["T"] == t)
                        if not pts:
                            continue
                        top = max(top, max(p for _, p in pts))
                        ax.plot([b for b, _ in pts], [p for _, p in pts], style, marker=marker, ms=3.5,
                                lw=1.4, color=colors[t], label=f"T={t} {layout}")
                ax.axhline(100, color="black", lw=0.8, alpha=0.6)
                ax.set_title(f"{state} state")
                _b_axis(ax, bs)
            axes[0][0].set_ylabel("% of the same-bytes copy kernel")
            axes[0][0].set_ylim(0, 5 * (int(top) // 5 + 2))
            handles, labels = axes[0][0].get_legend_handles_labels()
            for ax in axes[0][1:]:  # a layout may be missing from the first panel
                for h, lab in zip(*ax.get_legend_handles_labels()):
                    if lab not in labels:
                        handles.append(h)
                        labels.append(lab)
            fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
            fig.suptitle(f"{model}, {mode}, T tokens per row, state updated, no cache: "
                         f"{doc.get('device', '?')}, gdn {doc.get('commit', '?')}", fontsize=10)
            fig.tight_layout(rect=(0, 0, 0.86, 1))
            paths.append(_save(fig, out, f"copy-{model}-{mode}.png", dpi))
    return paths


def plot_peers(doc, out, dpi):
    """fla_compare JSON -> vs-<peer>.png (vs-<peer>-<model>.png when the rows hold several
    models); returns the paths written."""
    rows = _decode_rows(doc["rows"])
    peers = sorted({k[:-3] for r in rows for k in r if k.endswith("_us") and k not in NOT_PEERS})
    if not peers:
        raise ValueError("no <peer>_us fields in the rows")
    models = sorted({r.get("model") for r in rows}, key=str)  # None: rows written before --model existed
    paths = []
    for model in models:
        mrows = [r for r in rows if r.get("model") == model]
        suffix = f"-{model}" if len(models) > 1 else ""
        for peer in peers:
            paths.append(_plot_peer(doc, mrows, peer, model, out, f"vs-{peer}{suffix}.png", dpi))
    return paths


def _plot_peer(doc, rows, peer, model, out, name, dpi):
    key = f"{peer}_us"
    states = _states(rows)
    colors = _t_colors({r["T"] for r in rows})
    bs = sorted({r["B"] for r in rows})
    fig, axes = plt.subplots(1, len(states), figsize=(4.6 * len(states), 3.9), sharey=True, squeeze=False)
    for ax, state in zip(axes[0], states):
        for t in sorted(colors):
            sel = sorted((r for r in rows if r["state"] == state and r["T"] == t and key in r), key=lambda r: r["B"])
            if not sel:
                continue
            ax.plot([r["B"] for r in sel], [r[key] / r["gdn_us"] for r in sel], "-o", ms=3.5, lw=1.4,
                    color=colors[t], label=f"T={t}")
            oop = [r for r in sel if "gdn_oop_us" in r]
            if oop:
                ax.plot([r["B"] for r in oop], [r[key] / r["gdn_oop_us"] for r in oop], ":", lw=1.2,
                        color=colors[t], label=f"T={t}, gdn out of place")
        ax.axhline(1, color="black", lw=0.8, alpha=0.6)
        ax.set_title(f"{state} state")
        _b_axis(ax, bs)
    axes[0][0].set_ylabel(f"{peer.upper()} time / gdn time")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    version = doc.get(f"{peer}_version")
    shape = doc.get("shape", {})
    fig.suptitle(f"{peer.upper()}{' ' + version if version else ''} against gdn "
                 f"{doc.get('gdn_commit', '?')} (> 1: gdn faster), {model + ', ' if model else ''}"
                 f"{shape.get('mode', '')} {shape.get('layout', '')}: {doc.get('device', '?').split(',')[0]}",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.82, 1))
    return _save(fig, out, name, dpi)


DRIFT_COLORS = {"fp32": "black", "bf16": "tab:blue", "fp16": "tab:orange"}


def plot_drift(doc, out, dpi):
    """gdn drift JSON -> drift.png; returns the path."""
    modes = doc["modes"]
    if not modes:
        raise ValueError("no modes in the drift JSON")
    fig, axes = plt.subplots(2, len(modes), figsize=(4.8 * len(modes), 6.6), sharex=True, sharey="row",
                             squeeze=False)
    for col, mode in enumerate(modes):
        x = mode["tokens"]
        for row, key, what in ((0, "o_mean", "o"), (1, "state_err", "state")):
            ax = axes[row][col]
            for v in mode["variants"]:
                sr = v["rounding"] == "stochastic"
                ax.plot(x, v[key], "--" if sr else "-", lw=1.5 if sr else 1.3,
                        color=DRIFT_COLORS.get(v["state"], "gray"), label=v["name"])
            ax.set_xscale("log", base=2)
            ticks = [4 ** i for i in range(12) if 4 ** i <= max(x) * 1.01]
            ax.set_xticks(ticks)
            ax.set_xticklabels([str(t) for t in ticks])
            ax.set_yscale("log")
            ax.grid(True, which="major", alpha=0.3)
            if col == 0:
                ax.set_ylabel(f"relative error of {what}")
            if row == 0:
                title = "decode, T = 1" if mode["T"] == 1 else f"speculative verify, T = {mode['T']}"
                ax.set_title(title, fontsize=10)
            else:
                ax.set_xlabel("tokens (accepted, per row)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=9, frameon=False)
    shape = doc.get("shape", {})
    fig.suptitle(f"State drift against the float64 trajectory: {shape.get('model', '?')} TP {shape.get('tp', '?')}, "
                 f"B = {shape.get('B', '?')}, {doc.get('device', '?')}, gdn {doc.get('commit', '?')}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.87, 1))
    return _save(fig, out, "drift.png", dpi)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="gdn bench, gdn drift or bench/fla_compare.py JSON")
    p.add_argument("--out", default=".", help="folder for the PNGs (default: current folder)")
    p.add_argument("--dpi", type=int, default=100, help="resolution (default 100: small files for docs/img)")
    p.add_argument("--mode", nargs="+", help="gdn bench figures for these addressing modes only "
                   "(dense, pool, split; default: all in the file)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    seen = {}
    for path in args.files:
        with open(path) as f:
            doc = json.load(f)
        k = kind(doc)
        if k is None:
            p.error(f"{path}: neither a gdn bench or drift JSON nor a fla_compare JSON with decode rows")
        if k in seen:
            p.error(f"{path} and {seen[k]} would write the same figures: give each its own --out")
        seen[k] = path
        if k == "bench":
            plot_bench(doc, args.out, args.dpi, args.mode)
        elif k == "drift":
            plot_drift(doc, args.out, args.dpi)
        else:
            plot_peers(doc, args.out, args.dpi)
    return 0


if __name__ == "__main__":
    sys.exit(main())
