"""Write the figures table of docs/sandbox.md from bench/results/sandbox.json (between its markers).

Usage: python docs/sandbox_figures.py [--check]   (--check: exit 1 if the page's table is stale)
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS, PAGE = ROOT / "bench/results/sandbox.json", ROOT / "docs/sandbox.md"
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"


def table(r: dict) -> str:
    rows = ["| measure | sandboxed p50 | baseline p50 | overhead / figure | goal | met |",
            "| --- | --- | --- | --- | --- | --- |"]
    for mode, key in (("cold", "isolation_overhead_cold_p50_ms"), ("pre-started", "isolation_overhead_warm_p50_ms")):
        fig, t = r["isolation_" + ("cold" if mode == "cold" else "warm")], r["targets"][key]
        rows.append(f"| isolation, {mode} (ms) | {fig['sandboxed']['p50_ms']} | {fig['bare']['p50_ms']} (bare) | "
                    f"{t['value']} (median of {fig['sandboxed']['calls']} pairs) | {t['goal']} | {'yes' if t['met'] else 'NO'} |")
    for n in ("1_client", "8_clients"):
        s, p = r[f"sandbox_service_{n}"], r[f"plain_subprocess_{n}"]
        t = r["targets"]["calls_per_s_8_clients"] if n == "8_clients" else None
        rows.append(f"| service, {n.replace('_', ' ')} (ms; calls/s) | {s['p50_ms']}; {s['calls_per_s']} | "
                    f"{p['p50_ms']}; {p['calls_per_s']} (subprocess.run) | {s['calls_per_s']} calls/s | "
                    f"{t['goal'] if t else '-'} | {('yes' if t['met'] else 'NO') if t else '-'} |")
    load = r["load_avg_1m"]
    rows.append("")
    rows.append(f"{r['device']}, commit `{r['git_commit'][:12]}`, {r['date_utc']}, load average "
                f"{load['start']} → {load['end']} (a shared machine).")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    page = PAGE.read_text()
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{table(json.loads(RESULTS.read_text()))}\n{END}{tail}"
    if "--check" in argv:
        return 0 if new == page else 1
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
