"""The report of a pipeline run (also of a partly finished one): `report.json` with every figure,
`report.md`, a self-contained `report.html` (images inline) and the curves as PNGs.

Figures: every model on every domain (greedy pass@1) with each domain's retention (merged student over
that domain's teacher, in %) and each specialist's gain over the base; wall time per stage; faults
injected and survived; the resolved config.
"""
from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from core.atomic import write_atomic
from deploy import manifest
from deploy.pipeline_config import STAGES
from deploy.run_records import read_record


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill
    return out


def collect(run_dir: Path) -> dict:
    run_dir = Path(run_dir)
    meta = (read_record(run_dir / "pipeline.json", {"config": dict}, "rerun the pipeline with --force")
            if (run_dir / "pipeline.json").is_file() else {})
    cfg = meta.get("config", {})
    domains = cfg.get("pipeline", {}).get("domains", [])
    stages = {}
    for stage in STAGES[:-1]:
        doc = manifest.read(run_dir / stage)
        stages[stage] = {"status": "done" if doc else ("started" if (run_dir / stage).exists() else "not started"),
                         "wall_s": doc.get("wall_s") if doc else None}
    spec = manifest.read(run_dir / "specialists") or {}
    trained = spec.get("trained", [])
    results_path = run_dir / "evaluate" / "results.json"
    table = (read_record(results_path, {"pass_at_1": dict}, "rerun the pipeline (its evaluate stage runs again)")
             ["pass_at_1"] if results_path.is_file() else {})
    if not table and spec.get("base_eval"):
        table = {"base": spec["base_eval"]}
    teacher_of = {d: (f"specialist:{d}" if d in trained else "base") for d in domains}
    retention, gain = {}, {}
    if "merged" in table:
        for d in domains:
            teacher = table.get(teacher_of[d], {}).get(d)
            if teacher:
                retention[d] = table["merged"][d] / teacher
    for d in trained:
        if f"specialist:{d}" in table and "base" in table:
            gain[d] = table[f"specialist:{d}"][d] - table["base"][d]
    faults = {"injected": 0, "tokens_lost": 0, "tokens_resampled": 0, "replacements": 0}
    runs = [run_dir / "specialists" / d / "metrics.jsonl" for d in domains] + [run_dir / "merge" / "run" / "metrics.jsonl"]
    for path in runs:
        for r in _rows(path):
            if r.get("stage") == "train":
                faults["injected"] += int(r.get("faults", 0))
                faults["tokens_lost"] += int(r.get("tokens_lost", 0))
                faults["tokens_resampled"] += int(r.get("tokens_resampled", 0))
                faults["replacements"] += int(r.get("replacements", 0))
    faults["survived"] = faults["injected"] if faults["tokens_lost"] == faults["tokens_resampled"] == 0 else None
    walls = [s["wall_s"] for s in stages.values() if s["wall_s"] is not None]
    return {"name": run_dir.name, "domains": domains, "quick": meta.get("quick"), "stages": stages,
            "wall_min": round(sum(walls) / 60, 2) if walls else None, "pass_at_1": table, "teacher_of": teacher_of,
            "trained": trained, "retention": retention, "retention_min": min(retention.values()) if retention else None,
            "specialist_gain": gain, "specialist_gain_min": min(gain.values()) if gain else None,
            "faults": faults, "config": cfg}


def plot_curves(run_dir: Path, rep: dict) -> dict[str, Path]:
    """grpo.png (each specialist's pass@1), plus the SFT and OPD plots the stages wrote."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    sft_png = run_dir / "sft" / "sft.png"
    if sft_png.is_file():
        out["sft"] = sft_png
    curves = {d: [r for r in _rows(run_dir / "specialists" / d / "metrics.jsonl") if r.get("stage") == "eval"]
              for d in rep["trained"]}
    if any(curves.values()):
        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        for d, rows in curves.items():
            ax.plot([r["time_s"] / 60 for r in rows], [r["eval_pass_at_1"] for r in rows], marker=".", label=f"GRPO {d}")
        ax.set_xlabel("wall time (min)")
        ax.set_ylabel("greedy pass@1")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title("specialists")
        fig.tight_layout()
        path = run_dir / "grpo.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out["grpo"] = path
    opd_png = run_dir / "merge" / "run" / "opd.png"
    if opd_png.is_file():
        out["opd"] = opd_png
    return out


def to_markdown(rep: dict, images: dict[str, Path], run_dir: Path) -> str:
    lines = [f"# Pipeline report: {rep['name']}", ""]
    models = list(rep["pass_at_1"])
    if models:
        lines += ["| model | " + " | ".join(rep["domains"]) + " |", "| --- |" + " --- |" * len(rep["domains"])]
        for m in models:
            lines.append(f"| {m} | " + " | ".join(f"{rep['pass_at_1'][m].get(d, float('nan')):.3f}" for d in rep["domains"]) + " |")
        if rep["retention"]:
            lines.append("| **retention** (merged / teacher) | " + " | ".join(
                f"{100 * rep['retention'][d]:.1f} %" if d in rep["retention"] else "—" for d in rep["domains"]) + " |")
        lines += ["", "Teachers: " + ", ".join(f"{d}: {t}" for d, t in rep["teacher_of"].items()) + ". Greedy pass@1, "
                  f"n = {rep['config'].get('evaluate', {}).get('n')} per domain."]
    if rep["specialist_gain"]:
        lines += ["", "Specialist gain over the base: " + ", ".join(f"{d} {g:+.3f}" for d, g in rep["specialist_gain"].items())]
    lines += ["", "| stage | status | wall time |", "| --- | --- | --- |"]
    for s, v in rep["stages"].items():
        wall = "" if v["wall_s"] is None else f"{v['wall_s']:.0f} s"
        lines.append(f"| {s} | {v['status']} | {wall} |")
    if rep["wall_min"] is not None:
        lines.append(f"| **total** | | {rep['wall_min']:.1f} min |")
    f = rep["faults"]
    if f["injected"]:
        lines += ["", f"Faults injected: {f['injected']}, survived: {f['survived']}; tokens lost {f['tokens_lost']}, "
                  f"tokens re-sampled {f['tokens_resampled']}, worker replacements {f['replacements']}."]
    for name, path in images.items():
        lines += ["", f"![{name}]({Path(path).relative_to(run_dir)})"]
    lines += ["", "<details><summary>resolved config</summary>", "", "```json",
              json.dumps(rep["config"], indent=2), "```", "</details>", ""]
    return "\n".join(lines)


def to_html(markdown_text: str, images: dict[str, Path], run_dir: Path) -> str:
    """A self-contained page: the markdown's tables and text, images inlined as data URIs."""
    body, table = [], []

    def flush_table():
        if table:
            rows = [r for r in table if not set(r.replace("|", "").strip()) <= {"-", " "}]
            cells = [[c.strip() for c in r.strip().strip("|").split("|")] for r in rows]
            head = "".join(f"<th>{html.escape(c)}</th>" for c in cells[0])
            rest = "".join("<tr>" + "".join(f"<td>{html.escape(c.replace('**', ''))}</td>" for c in r) + "</tr>" for r in cells[1:])
            body.append(f"<table><tr>{head}</tr>{rest}</table>")
            table.clear()

    inline = {str(Path(p).relative_to(run_dir)): base64.b64encode(Path(p).read_bytes()).decode() for p in images.values()}
    in_code = False
    for line in markdown_text.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        flush_table()
        if line.startswith("```"):
            body.append("</pre>" if in_code else "<pre>")
            in_code = not in_code
        elif in_code:
            body.append(html.escape(line))
        elif line.startswith("# "):
            body.append(f"<h1>{html.escape(line[2:])}</h1>")
        elif line.startswith("!["):
            src = line[line.index("(") + 1:-1]
            body.append(f'<p><img src="data:image/png;base64,{inline[src]}" alt="{html.escape(src)}"></p>')
        elif line.startswith("<"):
            body.append(line)
        elif line:
            body.append(f"<p>{html.escape(line)}</p>")
    flush_table()
    style = "body{font-family:sans-serif;max-width:60em;margin:2em auto}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.3em .6em}"
    return f"<!doctype html><html><head><meta charset='utf-8'><title>pipeline report</title><style>{style}</style></head><body>{''.join(body)}</body></html>\n"


def write_report(run_dir: str | Path) -> dict:
    """report.json, report.md, report.html and the curves of `run_dir` (finished or not); returns the figures."""
    run_dir = Path(run_dir)
    rep = collect(run_dir)
    images = plot_curves(run_dir, rep)
    rep["images"] = {k: str(Path(v).relative_to(run_dir)) for k, v in images.items()}
    md = to_markdown(rep, images, run_dir)
    write_atomic(run_dir / "report.json", json.dumps(rep, indent=2).encode())
    write_atomic(run_dir / "report.md", md.encode())
    write_atomic(run_dir / "report.html", to_html(md, images, run_dir).encode())
    return rep


def final_table(rep: dict) -> str:
    """The table printed at the end of a pipeline: models x domains, retention."""
    if not rep["pass_at_1"]:
        return "(no evaluation yet)"
    width = max(len(m) for m in rep["pass_at_1"]) + 2
    lines = [" " * width + "".join(f"{d:>10}" for d in rep["domains"])]
    for m, row in rep["pass_at_1"].items():
        lines.append(f"{m:<{width}}" + "".join(f"{row.get(d, float('nan')):>10.3f}" for d in rep["domains"]))
    if rep["retention"]:
        lines.append(f"{'retention':<{width}}" + "".join(
            f"{100 * rep['retention'][d]:>9.1f}%" if d in rep["retention"] else f"{'—':>10}" for d in rep["domains"]))
    return "\n".join(lines)
