"""An offline target cache: the frozen target run once over a token stream, so the drafter trainers
(`train.block`, and through `TargetCache` any trainer that reads the target) run many epochs at
drafter-only cost.

Per window of `seq_len` tokens it stores, in shards of `shard_windows` windows:

    tokens.npy      int32 [S, T]             the window
    features.npy    bf16  [S, T, L*E]        the target's hidden states at `layers`, concatenated
                                             (stored as their uint16 bits; `TargetCache` views them back)
    topk_ids.npy    int32 [S, T, k]          the target's k most likely next tokens at every position
    topk_logp.npy   f16   [S, T, k]          their log-probabilities (the distillation target)
    states.npy      bf16  [L_s, S, G, H, dk, dv]   hybrid targets with `state_layers` (ReaDy): the read
                                             layers' committed recurrent states on a grid of `state_every`
                                             (entry g: after tokens < g * state_every)

and `manifest.json`: the format, the target's weights digest and weight dtype (`--weights`), layers, k, seq_len, the stream's
digest, the shard count done. A shard is written to a temporary directory and renamed when whole,
then counted in the manifest, so a stopped build continues where it ended (`build` again with the
same arguments); other arguments are refused. Memory-mapped reads: a cache larger than memory works.

    python -m train.target_cache --target models/code-target --layers 1,4,6 --out runs/cache/code-target \\
        --windows 4096 [--extra runs/code-target-continuations.npy --extra-repeat 2] [--corpus-tokens N]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm import tqdm

from specjax.models import sharding
from specjax.io.checkpoint import load_model, load_tokenizer, weights_sha256
from specjax.models import family, hybrid, transformer
from train import data
from train.lm import load_streams_for
from train.common import resolve

FORMAT = "specjax-target-cache-v1"
MANIFEST = "manifest.json"


def stream_sha256(stream: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(stream, dtype=np.int32).tobytes()).hexdigest()


def windows_of(stream: np.ndarray, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    """[N, seq_len] consecutive windows of the stream (every token once)."""
    n = len(stream) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"the token stream ({len(stream)} tokens) is shorter than one window of {seq_len}")
    return np.asarray(stream[: n * seq_len], np.int32).reshape(n, seq_len)


def _target_fn(target, layers: tuple[int, ...], topk: int, read: tuple[int, ...], every: int):
    """A jitted pass: tokens [B, T] -> (features [B, T, L*E] bf16, top-k ids, top-k log-probs, states)."""

    @jax.jit
    def run(tokens_BxT):
        B, T = tokens_BxT.shape
        states = None
        if read:
            out, states = hybrid.prefix_states(target, tokens_BxT, every, hidden_layers=layers, read=read)
            states = states.astype(jnp.bfloat16)
        else:
            fam = family(target)
            out = fam.forward(target, tokens_BxT, jnp.broadcast_to(jnp.arange(T)[None], (B, T)),
                              fam.init_cache(target, B, T), transformer.causal_mask(B, T), hidden_layers=layers)
        logp = jax.nn.log_softmax(out.logits.astype(jnp.float32), axis=-1)
        lp, ids = jax.lax.top_k(logp, topk)
        feats = jnp.concatenate(out.hidden, axis=-1).astype(jnp.bfloat16)
        return feats, ids.astype(jnp.int32), lp.astype(jnp.float16), states

    return run


def _manifest(out: Path) -> dict | None:
    f = out / MANIFEST
    return json.loads(f.read_text()) if f.exists() else None


def _write_manifest(out: Path, m: dict) -> None:
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(m, indent=1))
    os.replace(tmp, out / MANIFEST)


def build(target_dir: str, stream: np.ndarray, out, *, layers: tuple[int, ...], topk: int = 32, seq_len: int = 512,
          shard_windows: int = 64, batch: int = 8, max_windows: int | None = None, state_layers: tuple[int, ...] = (),
          state_every: int = 8, mix: dict | None = None, weights: str = "float32", progress: bool = True) -> dict:
    """Builds (or continues) the cache of `stream` under `out`; returns the manifest. `mix`: how the
    stream was made (recorded for the drafter's card). `weights`: the target's weight dtype for the
    pass (`load_model(weights=...)`, batch-invariant attention at bf16 / int8): distil from the
    target as it is deployed; the trainers then load their target at the cache's `weights`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_model(target_dir, weights=weights)
    cfg = target.config
    layers = tuple(int(x) for x in layers)
    if not layers or max(layers) >= cfg.num_layers:
        raise ValueError(f"layers {layers} must be target layers 0..{cfg.num_layers - 1}")
    if not 1 <= topk <= cfg.vocab_size:
        raise ValueError(f"topk must be in 1..{cfg.vocab_size}, got {topk}")
    read = ()
    if state_layers:
        linear = tuple(getattr(cfg, "linear_layers", ()))
        missing = [x for x in state_layers if x not in linear]
        if missing:
            raise ValueError(f"state_layers {missing} are not Gated DeltaNet layers of the target ({linear or 'none'})")
        read = tuple(linear.index(x) for x in state_layers)
    wins = windows_of(stream, seq_len, max_windows)
    n_shards = -(-len(wins) // shard_windows)
    want = {"format": FORMAT, "target": str(target_dir), "target_sha256": weights_sha256(target_dir),
            "layers": list(layers), "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "topk": topk,
            "seq_len": seq_len, "shard_windows": shard_windows, "windows": int(len(wins)), "shards": n_shards,
            "stream_sha256": stream_sha256(wins), "state_layers": list(state_layers), "state_every": state_every,
            "weights": weights, "mix": mix or {}}
    have = _manifest(out)
    if have is not None:
        have.setdefault("weights", "float32")  # caches from before the option
        differ = [k for k in want if k not in ("target", "mix") and have.get(k) != want[k]]
        if differ:
            raise ValueError(f"{out}: a cache of other {differ} is there; remove it or choose another --out")
        want["done"], want["seconds"] = have.get("done", 0), have.get("seconds", 0.0)
    else:
        want["done"], want["seconds"] = 0, 0.0
    _write_manifest(out, want)
    run = _target_fn(target, layers, topk, read, state_every)
    bar = tqdm(total=n_shards, initial=want["done"], desc="target cache", unit="shard", disable=not progress)
    for s in range(want["done"], n_shards):
        t0 = time.perf_counter()
        part = wins[s * shard_windows:(s + 1) * shard_windows]
        got = {"features": [], "topk_ids": [], "topk_logp": [], "states": []}
        for i in range(0, len(part), batch):
            toks = part[i:i + batch]
            pad = batch - len(toks)  # the last batch padded to one compiled shape
            feats, ids, lp, st = run(jnp.asarray(np.concatenate([toks, np.zeros((pad, seq_len), np.int32)]) if pad else toks))
            keep = len(toks)
            got["features"].append(np.asarray(feats)[:keep].view(np.uint16))
            got["topk_ids"].append(np.asarray(ids)[:keep])
            got["topk_logp"].append(np.asarray(lp)[:keep])
            if st is not None:
                got["states"].append(np.asarray(st)[:, :keep].view(np.uint16))
        tmp = out / f"shard-{s:05d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        np.save(tmp / "tokens.npy", part)
        for k, v in got.items():
            if v:
                np.save(tmp / f"{k}.npy", np.concatenate(v, axis=1 if k == "states" else 0))
        final = out / f"shard-{s:05d}"
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        want["done"], want["seconds"] = s + 1, round(want["seconds"] + time.perf_counter() - t0, 1)
        _write_manifest(out, want)
        bar.update(1)
    bar.close()
    return want


def cache_weights(path) -> str:
    """The target's weight dtype a built cache was made with, from its manifest alone (float32 for
    caches from before the option): the trainers load their target at it."""
    m = _manifest(Path(path))
    if m is None or m.get("format") != FORMAT:
        raise ValueError(f"{path}: not a target cache (no {MANIFEST} of format {FORMAT})")
    return m.get("weights", "float32")


class TargetCache:
    """A built cache, memory-mapped. `batch(idx)` gathers windows; `batch_at(step, B, seed)` walks
    epochs in a fresh order each (the trainers' `data.batch_at` over windows)."""

    def __init__(self, path, target_dir: str | None = None, layers: tuple[int, ...] | None = None):
        self.path = Path(path)
        m = _manifest(self.path)
        if m is None or m.get("format") != FORMAT:
            raise ValueError(f"{self.path}: not a target cache (no {MANIFEST} of format {FORMAT})")
        if m["done"] < m["shards"]:
            raise ValueError(f"{self.path}: the cache is unfinished ({m['done']} of {m['shards']} shards): "
                             "run python -m train.target_cache again with the same arguments")
        if target_dir is not None and weights_sha256(target_dir) != m["target_sha256"]:
            raise ValueError(f"{self.path}: built from other target weights than {target_dir}")
        if layers is not None and not set(layers) <= set(m["layers"]):
            raise ValueError(f"{self.path}: holds target layers {m['layers']}, the drafter reads {tuple(layers)}")
        # The drafter's layers, in its order, as indices into the cache's (None: all, as stored).
        self.select = (None if layers is None or tuple(layers) == tuple(m["layers"])
                       else [list(m["layers"]).index(i) for i in layers])
        self.manifest = m
        self.shards = []
        for s in range(m["shards"]):
            d = self.path / f"shard-{s:05d}"
            load = lambda name, d=d: np.load(d / f"{name}.npy", mmap_mode="r") if (d / f"{name}.npy").exists() else None  # noqa: E731
            self.shards.append({k: load(k) for k in ("tokens", "features", "topk_ids", "topk_logp", "states")})
        self.per = m["shard_windows"]

    def __len__(self) -> int:
        return self.manifest["windows"]

    @property
    def positions(self) -> int:
        return len(self) * self.manifest["seq_len"]

    def tokens(self) -> np.ndarray:
        """Every window's tokens, in order [windows * seq_len] (what a reduced draft vocabulary is ranked on)."""
        return np.concatenate([np.asarray(sh["tokens"]).reshape(-1) for sh in self.shards])[:self.positions]

    def argmax_share(self, ids) -> float:
        """The share of the cached positions whose target argmax (top-1) is one of `ids`."""
        inside = np.zeros(self.manifest["vocab_size"], bool)
        inside[np.asarray(ids)] = True
        hit = sum(int(inside[np.asarray(sh["topk_ids"][..., 0])].sum()) for sh in self.shards)
        return hit / sum(sh["topk_ids"].shape[0] * sh["topk_ids"].shape[1] for sh in self.shards)

    def batch(self, idx) -> dict:
        """{tokens [B, T] int32, features [B, T, F] bf16, topk_ids [B, T, k], topk_logp [B, T, k] f32,
        states [L_s, B, G, H, dk, dv] bf16 or None} for windows `idx`."""
        rows = [(int(i) // self.per, int(i) % self.per) for i in idx]
        get = lambda k: [self.shards[s][k][r] for s, r in rows]  # noqa: E731
        feats = np.stack(get("features")).view(ml_dtypes.bfloat16)
        if self.select is not None:  # the drafter reads some of the stored layers: [B, T, L*E] -> [B, T, L'*E]
            B, T, F = feats.shape
            L = len(self.manifest["layers"])
            feats = feats.reshape(B, T, L, F // L)[:, :, self.select].reshape(B, T, -1)
        out = {"tokens": np.stack(get("tokens")),
               "features": feats,
               "topk_ids": np.stack(get("topk_ids")),
               "topk_logp": np.stack(get("topk_logp")).astype(np.float32), "states": None}
        if self.shards[0]["states"] is not None:
            out["states"] = np.stack([self.shards[s]["states"][:, r] for s, r in rows], axis=1).view(ml_dtypes.bfloat16)
        return out

    def step_batch(self, step: int, batch_size: int, seed: int, mesh=None, states: bool = True):
        """(tokens [B, T] numpy, the rest as device arrays) of a training step: rows over the mesh's
        `data` axis where there is one (states replicated); `states=False` leaves them out."""
        got = self.batch_at(step, batch_size, seed)
        tokens = got.pop("tokens")
        place = lambda k, v: jnp.asarray(v) if mesh is None or k == "states" else sharding.place(v, sharding.BATCH, mesh)  # noqa: E731
        return tokens, {k: place(k, v) for k, v in got.items() if v is not None and (states or k != "states")}

    def batch_at(self, step: int, batch_size: int, seed: int) -> dict:
        n = len(self)
        sample = step * batch_size + np.arange(batch_size)
        return self.batch([data._epoch_order(seed, 0, int(s // n), n)[s % n] for s in sample])


def dense_logits(topk_ids_xK, topk_logp_xK, vocab_size: int):
    """The cached top-k as logits over the vocabulary: their log-probabilities, -inf elsewhere (a
    softmax gives the target's distribution renormalised over its k most likely tokens)."""
    shape = topk_ids_xK.shape[:-1] + (vocab_size,)
    flat = jnp.full((int(np.prod(shape[:-1])), vocab_size), -jnp.inf, jnp.float32)
    rows = jnp.arange(flat.shape[0])[:, None]
    flat = flat.at[rows, topk_ids_xK.reshape(-1, topk_ids_xK.shape[-1])].set(
        topk_logp_xK.reshape(-1, topk_logp_xK.shape[-1]).astype(jnp.float32))
    return flat.reshape(shape)


def extra_stream(spec: str) -> np.ndarray:
    """`--extra`: one .npy token stream, or several comma-separated, joined in order (int32)."""
    files = [f for f in spec.split(",") if f]
    if not files:
        raise ValueError(f"--extra {spec!r}: no file named")
    return np.concatenate([np.load(f, allow_pickle=False).astype(np.int32).reshape(-1) for f in files])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--layers", required=True, help="target layers whose hidden states are stored, e.g. 1,4,6")
    ap.add_argument("--out", required=True)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--windows", type=int, default=None, help="at most this many windows of the stream")
    ap.add_argument("--shard-windows", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--extra", default=None,
                    help="a .npy token stream (the target's continuations) mixed in; several: comma-separated, joined")
    ap.add_argument("--extra-repeat", type=int, default=1)
    ap.add_argument("--corpus-tokens", type=int, default=None,
                    help="the corpus's first N training tokens only (sets the extra's share when --windows cuts)")
    ap.add_argument("--state-layers", default="", help="hybrid targets (ReaDy): Gated DeltaNet layers to store")
    ap.add_argument("--state-every", type=int, default=8)
    ap.add_argument("--weights", default="float32", choices=("float32", "bfloat16", "int8"),
                    help="the target's weight dtype for the pass: the dtype it is deployed at (default float32)")
    ap.add_argument("--manifest", default="train/manifest.json")
    args = ap.parse_args(argv)
    target_dir = str(resolve(args.target))
    streams = load_streams_for(load_tokenizer(target_dir), args.manifest, None, None, Path(args.out) / "token-cache")
    corpus = streams.train if args.corpus_tokens is None else streams.train[:args.corpus_tokens]
    parts, mix = [corpus], {"corpus_tokens": int(len(corpus))}
    if args.extra:
        extra = extra_stream(args.extra)
        mix.update(extra=args.extra, extra_tokens=int(len(extra)), extra_repeat=args.extra_repeat)
        parts.append(np.tile(extra, args.extra_repeat))
    stream = np.concatenate(parts)
    if args.extra:  # the target's own text interleaved with the corpus, window by window
        wins = windows_of(stream, args.seq_len)
        order = np.random.default_rng(0).permutation(len(wins))
        stream = wins[order].reshape(-1)
        mix["extra_share"] = round(len(extra) * args.extra_repeat / len(np.concatenate(parts)), 4)
    layers = tuple(int(x) for x in args.layers.split(","))
    state_layers = tuple(int(x) for x in args.state_layers.split(",")) if args.state_layers else ()
    m = build(target_dir, stream, args.out, layers=layers, topk=args.topk, seq_len=args.seq_len,
              shard_windows=args.shard_windows, batch=args.batch, max_windows=args.windows,
              state_layers=state_layers, state_every=args.state_every, mix=mix, weights=args.weights)
    print(f"{args.out}: {m['windows']} windows x {m['seq_len']} = {m['windows'] * m['seq_len']:,} positions, "
          f"{m['seconds']:.0f} s of target passes ({m['windows'] * m['seq_len'] / max(m['seconds'], 1e-9):.0f} positions/s)")


if __name__ == "__main__":
    main()
