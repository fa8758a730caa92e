#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Regenerates the tables and plots of docs/accuracy.md from the JSON files in docs/accuracy/.

Inputs (made by tools/accuracy/run_stories260k.sh), for each data set DS (e.g. stories260k-gen):
  docs/accuracy/eval-DS-B.json   `kvsieve eval --json` at budget B (mass recall, recall@k, error)
  docs/accuracy/eval-DS-B.txt    the same run's table (for the `kept` column, not in the JSON)
  docs/accuracy/e2e-DS.json      examples/python/kvsieve_e2e.py --json (NLL, greedy agreement)
Outputs:
  the blocks between `<!-- BEGIN accuracy_report: NAME -->` and `<!-- END accuracy_report: NAME -->`
  in docs/accuracy.md (NAME = summary, or tables-DS), and docs/img/accuracy-*.png (matplotlib).

  accuracy_report.py [--dir docs/accuracy] [--doc docs/accuracy.md] [--img docs/img] [--no-plots]
"""
import argparse
import glob
import json
import math
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BUDGETS = (0.01, 0.02, 0.05, 0.10, 0.20)
ORDER = ("full", "exact_topk", "streaming", "quest", "csattention", "ctkvr", "lfps", "hgca",
         "retroinfer")
TITLES = {"stories260k-gen": "stories260K, its own stories",
          "smollm2-kjv-8k": "SmolLM2-135M, KJV Genesis, 8K",
          "stories260k-text": "stories260K, KJV Genesis 1-2"}


def method_key(name):
    return (ORDER.index(name) if name in ORDER else len(ORDER), name)


def parse_kept(txt_path):
    """method -> kept fraction, from the table `kvsieve eval` prints."""
    kept = {}
    if not os.path.exists(txt_path):
        return kept
    with open(txt_path) as f:
        for line in f:
            m = re.match(r"^(\S+)\s+([0-9.eE+-]+)\s+([0-9.]+)%\s", line)
            if m:
                kept[m.group(1)] = float(m.group(3)) / 100.0
    return kept


def load(dirname):
    """{DS: {"eval": {(method, budget): row}, "e2e": doc or None}}"""
    data = {}
    for path in sorted(glob.glob(os.path.join(dirname, "eval-*.json"))):
        m = re.match(r"eval-(.+)-([0-9.]+)\.json$", os.path.basename(path))
        if not m:
            continue
        ds, budget = m.group(1), float(m.group(2))
        with open(path) as f:
            doc = json.load(f)
        kept = parse_kept(path[:-5] + ".txt")
        d = data.setdefault(ds, {"eval": {}, "e2e": None})
        for row in doc["methods"]:
            row = dict(row)
            row["kept"] = kept.get(row["name"])
            row["steps"] = doc.get("steps")
            d["eval"][(row["name"], budget)] = row
    for path in sorted(glob.glob(os.path.join(dirname, "e2e-*.json"))):
        ds = os.path.basename(path)[4:-5]
        with open(path) as f:
            doc = json.load(f)
        doc["_path"] = path
        data.setdefault(ds, {"eval": {}, "e2e": None})["e2e"] = doc
    return data


def e2e_rows(doc):
    """(method, budget) -> result row; full's single row (budget 1.0) also under every budget."""
    rows = {}
    if not doc:
        return rows
    for r in doc["results"]:
        rows[(r["method"], round(r["budget"], 6))] = r
    return rows


def fmt(x, spec):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return spec % x


def pct(v):
    return None if v is None else 100.0 * v


def long_table(ds, d):
    """Every method x budget: eval columns and end-to-end columns side by side."""
    ev, e2 = d["eval"], e2e_rows(d["e2e"])
    budgets = sorted({b for (_, b) in ev} | {b for (m, b) in e2 if m != "full"})
    methods = sorted({m for (m, _) in ev} | {m for (m, _) in e2}, key=method_key)
    out = ["| method | budget | kept (eval) | recall@k | mass recall | out err | out err p95 | "
           "kept (e2e) | NLL | ΔNLL vs full | KL vs full | greedy agree | 1st div |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in methods:
        for b in ([budgets[0]] if m == "full" else budgets):
            e = ev.get((m, b), {})
            r = e2.get((m, round(b, 6))) or (e2.get(("full", 1.0)) if m == "full" else None) or {}
            if not e and not r:
                continue
            out.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                m, "–" if m == "full" else "%g%%" % (100 * b),
                fmt(pct(e.get("kept")), "%.1f%%"),
                fmt(e.get("recall_at_k"), "%.3f"), fmt(e.get("mass_recall"), "%.3f"),
                fmt(e.get("output_rel_err"), "%.3f"), fmt(e.get("output_rel_err_p95"), "%.2f"),
                fmt(pct(r.get("kept_fraction")), "%.1f%%"),
                fmt(r.get("nll"), "%.4f"), fmt(r.get("delta_nll_vs_full"), "%+.4f") + (
                    " ± %.4f" % r["delta_nll_stderr"] if r.get("delta_nll_stderr") else ""),
                fmt(r.get("kl_vs_full"), "%.4f"),
                fmt(pct(r.get("greedy_agreement")), "%.1f%%"),
                fmt(r.get("first_divergence"), "%d")))
    head = []
    doc = d["e2e"]
    if doc:
        line = "End-to-end (`%s`): %s; text %s; prompt %d tokens, %d decode steps" % (
            os.path.basename(doc.get("_path", "")), doc["model"], doc["text"],
            doc["prompt_tokens"], doc["continuation_tokens"])
        if doc.get("windows", 1) > 1:
            line += ", %d windows (%d scored tokens)" % (doc["windows"], doc["scored_tokens"])
        if "reference_nll" in doc and "full_nll" in doc:
            line += ("; NLL (nats/token) of the NumPy float64 model %.5f, of `full` through "
                     "kvsieve %.5f (Δ %.1e)" % (doc["reference_nll"], doc["full_nll"],
                                               doc["full_nll"] - doc["reference_nll"]))
        if "full_greedy_equals_reference" in doc:
            line += "; full's greedy continuation %s the float64 model's" % (
                "equals" if doc["full_greedy_equals_reference"] else "differs from")
        head.append(line + ".")
    if ev:
        steps = next(iter(ev.values())).get("steps")
        head.append("`kvsieve eval`: %s decode steps x every layer, against float64 attention." % steps)
    return "\n".join([" ".join(head), ""] + out)


def pivot(data, metric, source, spec, title):
    """Rows: methods; columns: budgets; each cell one value per data set, joined by " / "."""
    sets = [ds for ds in sorted(data) if (data[ds]["eval"] if source == "eval" else data[ds]["e2e"])]
    out = ["**%s** (%s), %s:" % (title, "kvsieve eval" if source == "eval" else "end-to-end",
                                  " / ".join(sets)),
           "",
           "| method | %s |" % " | ".join("%g%%" % (100 * b) for b in BUDGETS),
           "|---|" + "---:|" * len(BUDGETS)]
    methods = set()
    for d in data.values():
        methods |= {m for (m, _) in d["eval"]}
        methods |= {r["method"] for r in (d["e2e"] or {}).get("results", [])}
    for m in sorted(methods, key=method_key):
        if m == "full":
            continue
        cells = []
        for b in BUDGETS:
            vals = []
            for ds in sets:
                if source == "eval":
                    row = data[ds]["eval"].get((m, b))
                else:
                    row = e2e_rows(data[ds]["e2e"]).get((m, round(b, 6)))
                vals.append(fmt(row.get(metric) if row else None, spec))
            cells.append(" / ".join(vals))
        if any(c.replace("–", "").replace(" / ", "") for c in cells):
            out.append("| %s | %s |" % (m, " | ".join(cells)))
    return "\n".join(out) if len(out) > 4 else ""


def plot(data, img_dir, cmd):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(img_dir, exist_ok=True)
    sets = sorted(data, key=lambda ds: (not ds.startswith("stories260k"), ds))
    made = []
    specs = [
        ("accuracy-mass-recall.png", "eval", "mass_recall", "mass recall (exact softmax weight kept)",
         "linear"),
        ("accuracy-nll.png", "e2e", "delta_nll_vs_full", "NLL change vs full (nats/token)", "symlog"),
        ("accuracy-kl.png", "e2e", "kl_vs_full", "KL(full || method) per token (nats)", "log"),
    ]
    for fname, source, metric, ylabel, yscale in specs:
        def has(ds):
            if source == "eval":
                return any(r.get(metric) is not None for r in data[ds]["eval"].values())
            return bool(data[ds]["e2e"]) and any(
                r.get(metric) is not None for r in data[ds]["e2e"]["results"])
        usable = [ds for ds in sets if has(ds)]
        if not usable:
            continue
        fig, axes = plt.subplots(1, len(usable), figsize=(6.2 * len(usable), 4.6), squeeze=False)
        for ax, ds in zip(axes[0], usable):
            d = data[ds]
            if source == "eval":
                pts = {}
                for (m, b), row in d["eval"].items():
                    if m == "full":
                        continue
                    x = row.get("kept") or b
                    pts.setdefault(m, []).append((x, row.get(metric), b))
            else:
                pts = {}
                for r in d["e2e"]["results"]:
                    if r["method"] == "full":
                        continue
                    pts.setdefault(r["method"], []).append(
                        (r["kept_fraction"] or r["budget"], r.get(metric), r["budget"]))
            for m in sorted(pts, key=method_key):
                p = sorted((x, y, b) for x, y, b in pts[m] if y is not None)
                if not p:
                    continue
                style = "--" if m in ("exact_topk", "streaming", "quest") else "-"
                ax.plot([100 * x for x, _, _ in p], [y for _, y, _ in p], style, marker="o",
                        markersize=4, label=m, color="black" if m == "exact_topk" else None)
            ax.set_xscale("log")
            ax.set_xticks([1, 2, 5, 10, 20, 40])
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.FuncFormatter(
                lambda v, _: "%g%%" % v))
            ax.set_xlabel("keys attended exactly (measured kept fraction, % of context)")
            ax.set_ylabel(ylabel)
            if yscale == "log":
                ax.set_yscale("log")
            if yscale == "symlog":
                ax.set_yscale("symlog", linthresh=1e-3)
                ax.axhline(0, color="grey", linewidth=0.8)
            ax.set_title(TITLES.get(ds, ds), fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
        fig.text(0.01, 0.005, cmd, fontsize=6, color="grey")
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        path = os.path.join(img_dir, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made


def replace_block(text, name, body):
    begin = "<!-- BEGIN accuracy_report: %s -->" % name
    end = "<!-- END accuracy_report: %s -->" % name
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        return text, False
    return text[:i + len(begin)] + "\n" + body.rstrip() + "\n" + text[j:], True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=os.path.join(REPO, "docs", "accuracy"),
                    help="folder of the JSON files (default docs/accuracy)")
    ap.add_argument("--doc", default=os.path.join(REPO, "docs", "accuracy.md"),
                    help="the document whose generated blocks are rewritten")
    ap.add_argument("--img", default=os.path.join(REPO, "docs", "img"), help="PNG folder")
    ap.add_argument("--no-plots", action="store_true", help="tables only (no matplotlib needed)")
    ap.add_argument("--print", action="store_true", help="print the blocks instead of writing")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.dir):
        print("accuracy_report.py: error: --dir: no such folder: %s" % args.dir, file=sys.stderr)
        return 2
    data = load(args.dir)
    if not data:
        print("accuracy_report.py: error: --dir: no eval-*.json or e2e-*.json in %s" % args.dir,
              file=sys.stderr)
        return 2
    blocks = {}
    # One summary per model (the data set name's first part: stories260k-gen -> stories260k).
    for model in sorted({ds.split("-")[0] for ds in data}):
        sub = {ds: d for ds, d in data.items() if ds.split("-")[0] == model}
        parts = []
        if any(d["eval"] for d in sub.values()):
            parts.append(pivot(sub, "mass_recall", "eval", "%.3f", "mass recall"))
        if any(d["e2e"] for d in sub.values()):
            parts += [pivot(sub, "delta_nll_vs_full", "e2e", "%+.3f", "ΔNLL vs full, nats/token"),
                      pivot(sub, "kl_vs_full", "e2e", "%.3f", "KL(full ‖ method), nats"),
                      pivot(sub, "greedy_agreement", "e2e", "%.3f", "greedy agreement")]
        blocks["summary-" + model] = "\n\n".join(p for p in parts if p)
    for ds in sorted(data):
        blocks["tables-" + ds] = long_table(ds, data[ds])
    if args.print:
        for k, v in blocks.items():
            print("## %s\n\n%s\n" % (k, v))
    else:
        with open(args.doc) as f:
            text = f.read()
        missing = []
        for k, v in blocks.items():
            text, ok = replace_block(text, k, v)
            if not ok:
                missing.append(k)
        with open(args.doc + ".tmp", "w") as f:
            f.write(text)
        os.replace(args.doc + ".tmp", args.doc)
        print("updated %s (%d blocks)" % (os.path.relpath(args.doc), len(blocks) - len(missing)))
        for k in missing:
            print("note: %s has no block %r (add BEGIN/END accuracy_report markers to include "
                  "it)" % (os.path.relpath(args.doc), k), file=sys.stderr)
    if not args.no_plots:
        for p in plot(data, args.img, "made by: python examples/python/accuracy_report.py "
                      "(data: docs/accuracy/*.json; stories260K: tools/accuracy/run_stories260k.sh)"):
            print("wrote %s" % os.path.relpath(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
