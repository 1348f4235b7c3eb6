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

`programs=True` also keeps the traced programs (`call`): the first process exports a generation program
(`jax.export`: its lowered StableHLO) into `<folder>/programs/`, under a key of everything that decides it
(the library's source, jax's version and flags, the static arguments in full, the inputs' structure,
shapes and dtypes); a later process deserializes and runs it without tracing or lowering the loop (the
CLI's warm start: seconds saved on a speculative program), and its compile is the persistent cache's hit.
A key that differs in anything runs the ordinary path. (Off by default: tests count traces.)

The folder is trusted: a process that loads an executable from it runs it, so do not share it with
users you do not trust (JAX's own warning).
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import jax
import jaxlib
import numpy as np
from jax import export
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
                             max_bytes: int = MAX_BYTES, programs: bool = False) -> Path | None:
    """Cache compiled programs in `path` (default: `default_dir()`) from now on; returns the folder,
    or None when $SPECJAX_COMPILE_CACHE says off and no path is given.

    Every program that took at least `min_compile_time_s` to compile is written (default 0: all of
    them, so the small eager helpers of loading and padding load from disk too), whatever its size;
    past `max_bytes` in the folder the least recently used entries are deleted (-1: no limit).
    Calling it again (with this folder or another, also after `disable_compilation_cache`) takes
    effect for the next compile. A folder that cannot be made raises ValueError. `programs`: also keep
    the traced generation programs there (`call`)."""
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
    global _PROGRAMS
    _PROGRAMS = folder / "programs" if programs and _exportable() else None
    return folder


def disable_compilation_cache() -> None:
    """Stop reading and writing the persistent cache in this process."""
    jax.config.update("jax_enable_compilation_cache", False)
    jax.config.update("jax_compilation_cache_dir", None)
    cc.reset_cache()
    global _PROGRAMS
    _PROGRAMS = None


# ----------------------------------------------------------------------------- traced programs

_PROGRAMS: Path | None = None
_LOADED: dict = {}  # key -> the deserialized program's jitted call (one per process)
_SOURCE: list = []  # the library's source digest, once per process
FLAGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_rank_promotion", "jax_disable_most_optimizations",
         "jax_default_prng_impl")


def disable_programs() -> None:
    """Stop keeping traced programs (the compilation cache itself stays as it is)."""
    global _PROGRAMS
    _PROGRAMS = None
    _LOADED.clear()


def _exportable() -> bool:
    """Whether `jax.export` can serialize here (it needs the flatbuffers package)."""
    try:
        import flatbuffers  # noqa: F401
    except ImportError:
        return False
    return True


def _source_digest() -> str:
    """sha256 of every .py file of specjax and pallas_kernels (a changed line is a new program)."""
    if not _SOURCE:
        h = hashlib.sha256()
        root = Path(__file__).resolve().parents[2]
        for pkg in ("specjax", "pallas_kernels"):
            for f in sorted((root / pkg).rglob("*.py")):
                h.update(str(f.relative_to(root)).encode())
                h.update(f.read_bytes())
        _SOURCE.append(h.hexdigest())
    return _SOURCE[0]


def _flag(name: str):
    """A jax config flag's value (flags with a context manager are attributes; the others are `read`)."""
    try:
        return getattr(jax.config, name)
    except AttributeError:
        return jax.config.read(name)


def program_key(fn, static_args: tuple, static_kwargs: dict, args) -> str:
    """Everything that decides the program `fn(*static_args, *args, **static_kwargs)` traces to, hashed:
    the source, jax's version, backend, XLA flags and lowering flags, the static arguments' full repr
    (numpy arrays unabridged), the inputs' tree structure, shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(args)
    with np.printoptions(threshold=sys.maxsize):
        parts = [_source_digest(), jax.__version__, getattr(jaxlib, "__version__", ""), jax.default_backend(),
                 str(jax.devices()[0].device_kind), os.environ.get("XLA_FLAGS", ""),
                 repr([(f, _flag(f)) for f in FLAGS]), f"{fn.__module__}.{fn.__qualname__}",
                 repr(static_args), repr(sorted(static_kwargs.items())), repr(treedef),
                 repr([(np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves])]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def call(fn, static_args: tuple, args: tuple, **static_kwargs):
    """`fn(*static_args, *args, **static_kwargs)` (`fn` jitted with those static arguments), through the
    traced-program store when `enable_compilation_cache(programs=True)` is on: exported on a miss,
    deserialized and run on a hit. Off: the plain call."""
    if _PROGRAMS is None:
        return fn(*static_args, *args, **static_kwargs)
    key = program_key(fn, static_args, static_kwargs, args)
    leaves, treedef = jax.tree.flatten(args)
    run = _LOADED.get(key)
    if run is None:
        path = _PROGRAMS / f"{key}.jaxexport"
        exp = None
        if path.is_file():
            try:
                exp = export.deserialize(bytearray(path.read_bytes()))
            except Exception:  # noqa: BLE001 - a damaged or foreign file: trace afresh and replace it
                exp = None
        if exp is None:
            exp = export.export(jax.jit(lambda *xs: fn(*static_args, *jax.tree.unflatten(treedef, xs),
                                                       **static_kwargs)))(*leaves)
            _PROGRAMS.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(exp.serialize())
            os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
        run = _LOADED[key] = jax.jit(exp.call)
    return run(*leaves)
