"""The one harness every bench uses: what a results file records, how it is written, and the
side-by-side runner the speed benches share. Run the tools from the repository root as modules
(`python -m tools.bench ...`); nothing here edits `sys.path`.

A results file, `<stem>.json`:

    {"meta": {"cpu", "cores", "date", "command", "python", "jax", "jaxlib", "backend", "device",
              "platform", "load_avg", ... the bench's own keys},
     "rows": [...],
     ... the bench's own extra keys}

`run_meta` makes the meta dict (`command` is the exact command line: `python -m tools.<name> ` +
the arguments, shell-quoted); `write_outputs` writes `<stem>.json`, `<stem>.md` (a title, the
header CPU / date / command, a markdown table of the rows) and, given a plot function, `<stem>.png`
(matplotlib, Agg). `python -m tools.report` reads these files, and the older schemas under bench/,
into docs/benchmarks.md and README's headline table.

The side-by-side runner (`time_generation`, `generation_row`, `with_speedup`, `greedy_check`): every
method timed in one process on the same prompt groups, untimed warm-up calls first (one per
prompt-length bucket, so every shape is compiled before timing), medians over repeated passes,
ratios to a baseline row (autoregressive) measured in the same run.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, Sequence

from specjax.spec.profile import cpu_name  # noqa: F401 - re-exported: the tools record it with every result

REPO = Path(__file__).resolve().parents[1]
NEAR_TIE = 1e-4  # a greedy divergence is an honest near-tie where the target's top-2 logits are this close


# ----------------------------------------------------------------------------- what a run records



def tool_command(tool: str, argv: Sequence[str] | None = None) -> str:
    """The command line of `python -m tools.<tool>` with `argv` (default: this process's arguments),
    quoted as a shell would need it."""
    args = list(sys.argv[1:] if argv is None else argv)
    return f"python -m tools.{tool}" + (" " + shlex.join(args) if args else "")


def run_meta(tool: str, argv: Sequence[str] | None = None, **extra) -> dict:
    """The meta dict of a results file: CPU model and cores, the date (ISO, UTC), the command line,
    the Python / jax / jaxlib versions, jax's backend and first device, the platform and the
    1-minute load average now; then the bench's own keys (`extra`, which may override these)."""
    import jax
    import jaxlib

    meta = {"cpu": cpu_name(), "cores": os.cpu_count(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": tool_command(tool, argv), "python": platform.python_version(),
            "jax": jax.__version__, "jaxlib": getattr(jaxlib, "__version__", None) or jaxlib.version.__version__,
            "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
            "platform": platform.platform(), "load_avg": os.getloadavg()[0]}
    meta.update(extra)
    return meta


def code_span(text: str) -> str:
    """`text` as markdown inline code, whatever backticks it holds (a fence longer than any run inside)."""
    run = longest = 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    fence = "`" * (longest + 1)
    pad = " " if longest else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def meta_header(meta: dict) -> list[str]:
    """Markdown lines saying where and how a result was measured: CPU, date, command (and the jax
    versions and device where recorded). Reads every schema's meta; what is missing says so."""
    cpu = meta.get("cpu") or "CPU model not recorded"
    if meta.get("cores"):
        cpu += f" ({meta['cores']} cores)"
    where = [f"CPU: {cpu}"]
    dev = [str(meta[k]) for k in ("device", "backend") if meta.get(k)]
    if dev:
        where.append("device: " + " / ".join(dict.fromkeys(dev)))
    if meta.get("jax"):
        where.append(f"jax {meta['jax']}" + (f", jaxlib {meta['jaxlib']}" if meta.get("jaxlib") else ""))
    where.append(f"date: {meta.get('date') or 'not recorded'}")
    lines = ["; ".join(where) + "."]
    if meta.get("command"):
        lines += ["", f"Command: {code_span(str(meta['command']))}"]
    return lines


# ----------------------------------------------------------------------------- tables and files

@dataclasses.dataclass(frozen=True)
class Column:
    """One column of a results table: `value` is a row key or a function of the row; `fmt` formats
    a present value (a missing key or None gives an empty cell); `right`: right-aligned (numbers)."""
    header: str
    value: str | Callable[[dict], object]
    fmt: str = "{}"
    right: bool = True

    def cell(self, row: dict) -> str:
        v = self.value(row) if callable(self.value) else row.get(self.value)
        if v is None:
            return ""
        text = v if isinstance(v, str) and self.fmt == "{}" else self.fmt.format(v)
        return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(columns: Sequence[Column], rows: Iterable[dict]) -> list[str]:
    lines = ["| " + " | ".join(c.header for c in columns) + " |",
             "|" + "|".join("---:" if c.right else "---" for c in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(c.cell(r) for c in columns) + " |")
    return lines


def output_path(path_stem, ext: str) -> Path:
    """`<stem><ext>`: a stem that already ends in .json / .md / .png loses that ending first (so
    `--out bench/x` and `--out bench/x.json` write the same files); other dots stay (`bench/run.v2`)."""
    stem = Path(path_stem)
    if stem.suffix in (".json", ".md", ".png"):
        stem = stem.with_suffix("")
    return stem.parent / (stem.name + ext)


def write_outputs(path_stem, meta: dict, rows: list[dict], table_columns: Sequence[Column] | None,
                  plot: Callable | None = None, *, title: str, intro: Sequence[str] = (),
                  notes: Sequence[str] = (), extra: dict | None = None, drop: Sequence[str] = ("sequences",),
                  quiet: bool = False) -> Path:
    """Writes `<stem>.json` ({"meta", "rows", **extra}; each row without the keys in `drop`),
    `<stem>.md` (# title, the meta header, `intro` lines, the table of `rows` in `table_columns`
    (None: no table), `notes` lines) and, with `plot(plt, rows, meta) -> figure`, `<stem>.png`.
    Returns the path of the markdown file."""
    md = output_path(path_stem, ".md")
    md.parent.mkdir(parents=True, exist_ok=True)
    kept = [{k: v for k, v in r.items() if k not in drop} for r in rows]
    output_path(path_stem, ".json").write_text(json.dumps({"meta": meta, "rows": kept, **(extra or {})}, indent=2) + "\n")
    lines = [f"# {title}", "", *meta_header(meta), ""]
    if intro:
        lines += [*intro, ""]
    if table_columns is not None:
        lines += [*markdown_table(table_columns, rows), ""]
    if notes:
        lines += [*notes, ""]
    md.write_text("\n".join(lines).rstrip("\n") + "\n")
    if plot is not None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig = plot(plt, rows, meta)
        fig.savefig(output_path(path_stem, ".png"), dpi=110)
        plt.close(fig)
    if not quiet:
        print(f"wrote {md}", file=sys.stderr)
    return md


# ----------------------------------------------------------------------------- timing

def median_ms(fn, repeats: int) -> float:
    """Median ms of `fn()` (blocked on: jitted calls) over `repeats` calls after a warm-up call."""
    import jax
    jax.block_until_ready(fn())  # compile + warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


# ----------------------------------------------------------------------------- the side-by-side runner

def batches(prompts: list[list[int]], size: int) -> list[list[list[int]]]:
    """Prompts in groups of `size` (a remainder that fills no group is left out)."""
    n = len(prompts) // size * size
    return [prompts[i:i + size] for i in range(0, n, size)]


def warmup_groups(groups):
    """One group per compiled shape (prompts are padded to the engine's bucket)."""
    from specjax.engine.loop import PROMPT_BUCKET
    from specjax.models.prefill import prompt_bucket
    seen = {}
    for g in groups:
        seen.setdefault(prompt_bucket(max(len(p) for p in g), PROMPT_BUCKET), g)
    return list(seen.values())


def time_generation(target, groups, repeats: int, *, warmup: str | None = "buckets", seed: int | None = None,
                    **kw) -> tuple[list, list[float]]:
    """`specjax.generate(target, group, **kw)` over every group, `repeats` timed passes (at least one)
    after untimed warm-up calls (`warmup`: "buckets", one per prompt-length bucket; "first", the
    first group only; None, none: the passes then include compilation). With `seed`, group i of a
    pass runs with seed + i. Returns (the last pass's results, seconds per pass)."""
    import specjax
    seeded = (lambda i: {}) if seed is None else (lambda i: {"seed": seed + i})
    warm = {"buckets": warmup_groups(groups), "first": groups[:1], None: []}[warmup]
    for g in warm:  # compile every shape (untimed), so the passes time decoding only
        specjax.generate(target, g, **seeded(0), **kw)
    times, results = [], None
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        results = [specjax.generate(target, g, **seeded(i), **kw) for i, g in enumerate(groups)]
        times.append(time.perf_counter() - t0)
    return results, times


def mean_verify_width(results) -> float:
    """Tree nodes the target verified per round over all rows (the engine's `verified_nodes`)."""
    rounds = sum(int(x.stats["rounds"].sum()) for x in results)
    return sum(int(x.stats["verified_nodes"].sum()) for x in results) / max(rounds, 1)


def generation_row(results, times: list[float], speculative: bool, drafter=None) -> dict:
    """A method's row from `time_generation`: tokens/s (tokens / the median pass), seconds, tokens
    and the sequences; a speculative method's tau (1 + accepted per round, bonus included),
    per-depth acceptance, mean verify width, and where the drafter reports them its mean draft
    length (block drafters), the adaptive shape's mean depth and, given the `drafter`, what it
    reports of itself over all rows (`Drafter.report`: a Switch's model-round share, TreeGraft's
    invocations), each section's values in the row. Autoregressive: tau 1."""
    import numpy as np
    seconds = statistics.median(times)
    tokens = sum(int(x.lengths.sum()) for x in results)
    row = {"tokens_per_s": tokens / seconds, "seconds": seconds, "tokens": tokens}
    if not speculative:
        row["tau"] = 1.0
    else:
        rounds = int(sum(int(x.stats["rounds"].sum()) for x in results))
        acc = sum(int(x.stats["accepted"].sum()) for x in results)
        row["tau"] = float(1 + acc / max(rounds, 1))
        if all("accepted_at_depth" in x.stats for x in results):
            at_depth = np.concatenate([x.stats["accepted_at_depth"] for x in results])
            row["depth_acceptance"] = (at_depth.sum(0) / max(rounds, 1)).round(3).tolist()
        if all("verified_nodes" in x.stats for x in results):
            row["mean_verify_width"] = mean_verify_width(results)
        if all("batch_nodes" in x.stats for x in results):  # nodes the verify forward computed per round
            row["mean_T"] = (sum(int(x.stats["batch_nodes"][0]) for x in results)
                             / max(sum(int(x.stats["batch_rounds"][0]) for x in results), 1))
        if all("drafted" in x.stats for x in results):  # a block drafter's
            row["mean_draft_len"] = sum(int(x.stats["drafted"].sum()) for x in results) / max(rounds, 1)
        if all("adaptive_depth" in x.stats for x in results):
            row["mean_adaptive_depth"] = sum(int(x.stats["adaptive_depth"].sum()) for x in results) / max(rounds, 1)
        if drafter is not None:
            keys = set.intersection(*(set(x.stats) for x in results))
            merged = {k: np.concatenate([np.atleast_1d(x.stats[k]) for x in results]) for k in keys}
            for section in drafter.report(merged).values():
                row.update(section)
    row["sequences"] = [s for x in results for s in x.sequences()]
    return row


def with_speedup(row: dict, baseline: dict) -> dict:
    """`row` with its speedup: tokens/s over the baseline row's (measured in the same run)."""
    row["speedup"] = row["tokens_per_s"] / baseline["tokens_per_s"]
    return row


def check_cell(r):
    """A row's greedy check as a table cell, 'exact / near-tie / mismatch' (None: the row has none)."""
    chk = r.get("check")
    return None if chk is None else f"{chk['exact']} / {chk['near_tie']} / {chk['mismatch']}"


def greedy_check(target, prompts, reference, candidate) -> dict:
    """Counts identical rows, honest near-ties (a divergence where the target's top-2 logits are
    within `NEAR_TIE`) and real mismatches of `candidate` against the greedy autoregressive
    `reference`."""
    import jax.numpy as jnp
    import numpy as np

    from specjax.models import family
    exact = near = mismatch = 0
    for p, a, b in zip(prompts, reference, candidate):
        if a == b:
            exact += 1
            continue
        i = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), None)
        if i is None:
            mismatch += 1
            continue
        ids = jnp.asarray([p + a[:i]], jnp.int32)
        fam = family(target)  # a dense or a hybrid target
        out = fam.prefill(target, ids, jnp.array([ids.shape[1]]), fam.init_cache(target, 1, ids.shape[1]))
        logits = np.asarray(out.logits[0, -1], np.float64)
        top = logits.max()
        if top - logits[a[i]] <= NEAR_TIE and top - logits[b[i]] <= NEAR_TIE:
            near += 1
        else:
            mismatch += 1
    return {"exact": exact, "near_tie": near, "mismatch": mismatch}


# ----------------------------------------------------------------------------- smoke models

def smoke_models(seed: int = 0, max_positions: int = 512, noise: float = 0.1):
    """(config, target, draft): a tiny random target and a noisy copy of it (an lm drafter that is
    often, not always, right). Shared by the tools' --smoke modes."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import specjax
    from specjax.models import transformer
    cfg = specjax.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=16, max_position_embeddings=max_positions)
    target = transformer.init_model(cfg, seed)
    draft = transformer.init_model(cfg, seed)
    leaves, tdef = jax.tree.flatten(nnx.state(draft, nnx.Param))
    keys = jax.random.split(jax.random.key(1), len(leaves))
    nnx.update(draft, jax.tree.unflatten(tdef, [x + noise * jnp.std(x) * jax.random.normal(k, x.shape)
                                               for x, k in zip(leaves, keys)]))
    return cfg, target, draft


def smoke_block_head(target_cfg, block_size: int = 8, markov_rank: int = 8, seed: int = 0, boundary: bool = False):
    """A tiny random BlockHead for the smoke modes, with a random confidence head (so confidences
    vary around 0.5 and cuts happen); `boundary`: DPara's."""
    import jax
    from flax import nnx

    from specjax.drafters.block import BlockConfig, BlockHead
    head = BlockHead(BlockConfig.for_target(target_cfg, block_size=block_size, num_layers=1, markov_rank=markov_rank,
                                            boundary=boundary), nnx.Rngs(seed))
    if head.confidence_w is not None:
        w = head.confidence_w.get_value()
        head.confidence_w.set_value(0.3 * jax.random.normal(jax.random.key(seed + 7), w.shape, w.dtype))
    return head
