"""A persistent compilation cache for the generation programs: JAX's own on-disk cache, switched
on with the thresholds that let every generation program in.

A `specjax.generate` program is traced, lowered to StableHLO and compiled by XLA on its first call
in a process; the last step is most of the cost (seconds on CPU) and is what the cache saves: a
second process with the same program (same shapes, drafter, tree, rule and jax / jaxlib version)
loads the executable from disk. Tracing and lowering still run.

    import specjax
    specjax.enable_compilation_cache()          # ~/.cache/specjax/jax-compile, or $SPECJAX_COMPILE_CACHE
    specjax.enable_compilation_cache("/tmp/c")  # a folder of your own

The CLI turns it on by default (`--compile-cache DIR`, `--no-compile-cache`); the library leaves
it to the caller. `SPECJAX_COMPILE_CACHE=off` turns the CLI's default off too.

The folder is trusted: a process that loads an executable from it runs it, so do not share it with
users you do not trust (JAX's own warning).
"""
from __future__ import annotations

import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache as cc

ENV = "SPECJAX_COMPILE_CACHE"
OFF = ("off", "0", "none", "false", "no")


def default_dir() -> Path | None:
    """$SPECJAX_COMPILE_CACHE (None if it says off), else $XDG_CACHE_HOME/specjax/jax-compile, else
    ~/.cache/specjax/jax-compile."""
    env = os.environ.get(ENV)
    if env is not None and env.strip():
        return None if env.strip().lower() in OFF else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specjax" / "jax-compile"


MAX_BYTES = 2 << 30  # least recently used entries go past this (JAX's own eviction)


def enable_compilation_cache(path: str | os.PathLike | None = None, *, min_compile_time_s: float = 0.0,
                             max_bytes: int = MAX_BYTES) -> Path | None:
    """Cache compiled programs in `path` (default: `default_dir()`) from now on; returns the folder,
    or None when $SPECJAX_COMPILE_CACHE says off and no path is given.

    Every program that took at least `min_compile_time_s` to compile is written (default 0: all of
    them, so the small eager helpers of loading and padding load from disk too), whatever its size;
    past `max_bytes` in the folder the least recently used entries are deleted (-1: no limit).
    Calling it again (with this folder or another, also after `disable_compilation_cache`) takes
    effect for the next compile. A folder that cannot be made raises ValueError."""
    if min_compile_time_s < 0:
        raise ValueError(f"min_compile_time_s must be >= 0, got {min_compile_time_s}")
    if max_bytes == 0 or max_bytes < -1:
        raise ValueError(f"max_bytes must be positive or -1 (no limit), got {max_bytes}")
    folder = Path(path).expanduser() if path is not None else default_dir()
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compilation cache folder {folder}: {e.strerror or e}") from None
    folder = folder.resolve()
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no size floor, no override
    jax.config.update("jax_compilation_cache_max_size", int(max_bytes))
    cc.reset_cache()  # JAX builds its cache object (and decides whether to use one) once: rebuild it
    return folder


def disable_compilation_cache() -> None:
    """Stop reading and writing the persistent cache in this process."""
    jax.config.update("jax_enable_compilation_cache", False)
    jax.config.update("jax_compilation_cache_dir", None)
    cc.reset_cache()
