"""The training corpus: every `.py` file of the running interpreter's standard library.

The stdlib is present on every machine, but its contents depend on the Python version, so a
manifest committed at `train/manifest.json` pins the exact files (relative path, split, sha256,
size). Everything that reads the corpus checks it first and refuses a different stdlib, rather
than silently training or evaluating on other text.

Split rule: a file's split is a function of its relative path only (sha256 of the path), so it
never changes when files are added or removed elsewhere: ~90% train, 5% validation, 5% test.

Excluded: `site-packages/` (installed packages, not the stdlib), `__pycache__/`, and the two
build-specific files (`_sysconfigdata_*.py`, `config-*/`) that embed the install prefix and so
differ between two installs of the same version. Files that are not valid UTF-8 (a few test
fixtures in legacy encodings) are kept in the manifest with split "skipped".

    python -m train.corpus --write-manifest     # (re)write train/manifest.json from this stdlib
    python -m train.corpus --check              # verify this interpreter's stdlib matches
"""
from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import hashlib
import json
import os
import platform
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

MANIFEST_PATH = Path(__file__).with_name("manifest.json")
SPLITS = ("train", "validation", "test")
SKIPPED = "skipped"  # not valid UTF-8
MANIFEST_FORMAT = 1
EXCLUDED_DIRS = ("site-packages", "__pycache__", "config-*")
EXCLUDED_FILES = ("_sysconfigdata_*.py",)


class CorpusMismatch(RuntimeError):
    """The stdlib on this machine is not the one the manifest was written from."""


@dataclasses.dataclass(frozen=True)
class CorpusFile:
    path: str  # relative to the stdlib root, '/'-separated
    split: str  # "train" | "validation" | "test" | "skipped"
    sha256: str
    n_bytes: int


@dataclasses.dataclass(frozen=True)
class Manifest:
    python: str  # platform.python_version() of the interpreter that wrote it
    implementation: str
    files: tuple[CorpusFile, ...]

    def split(self, name: str) -> list[CorpusFile]:
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; expected one of {', '.join(SPLITS)}")
        return [f for f in self.files if f.split == name]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(rel_path: str) -> str:
    """~90/5/5 by the path's hash: stable, and independent of every other file."""
    bucket = int.from_bytes(hashlib.sha256(rel_path.encode("utf-8")).digest()[:8], "big") % 100
    return "validation" if bucket < 5 else "test" if bucket < 10 else "train"


def list_files(root: Path) -> list[str]:
    """Relative paths of the corpus's .py files under `root`, sorted (the canonical order)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not any(fnmatch.fnmatch(d, p) for p in EXCLUDED_DIRS)]
        for name in filenames:
            if name.endswith(".py") and not any(fnmatch.fnmatch(name, p) for p in EXCLUDED_FILES):
                out.append(Path(dirpath, name).relative_to(root).as_posix())
    return sorted(out)


def scan(root: Path | None = None) -> Manifest:
    """Hashes every corpus file under `root` (default: this interpreter's stdlib)."""
    root = Path(root) if root is not None else stdlib_root()
    files = []
    for rel in list_files(root):
        data = (root / rel).read_bytes()
        try:
            data.decode("utf-8")
            split = split_of(rel)
        except UnicodeDecodeError:
            split = SKIPPED
        files.append(CorpusFile(rel, split, hashlib.sha256(data).hexdigest(), len(data)))
    return Manifest(python=platform.python_version(), implementation=platform.python_implementation(),
                    files=tuple(files))


def write_manifest(manifest: Manifest, path: Path = MANIFEST_PATH) -> None:
    # One file per line keeps the committed JSON small and its diffs readable.
    rows = ",\n".join("    " + json.dumps([f.path, f.split, f.sha256, f.n_bytes]) for f in manifest.files)
    counts = {s: sum(f.split == s for f in manifest.files) for s in SPLITS + (SKIPPED,)}
    header = {"format": MANIFEST_FORMAT, "python": manifest.python, "implementation": manifest.implementation,
              "counts": counts, "columns": ["path", "split", "sha256", "n_bytes"]}
    head = json.dumps(header, indent=2)[:-2]  # drop the closing "\n}" to append the rows
    Path(path).write_text(f'{head},\n  "files": [\n{rows}\n  ]\n}}\n')


def read_manifest(path: Path = MANIFEST_PATH) -> Manifest:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no corpus manifest; write it with `python -m train.corpus --write-manifest`")
    doc = json.loads(path.read_text())
    if doc.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path}: manifest format {doc.get('format')!r}, expected {MANIFEST_FORMAT}")
    return Manifest(python=doc["python"], implementation=doc["implementation"],
                    files=tuple(CorpusFile(*row) for row in doc["files"]))


def manifest_sha256(path: Path = MANIFEST_PATH) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def check(manifest: Manifest | None = None, root: Path | None = None, max_listed: int = 10) -> Manifest:
    """Raises `CorpusMismatch` naming every difference between `root` and the manifest: the
    Python version, and missing, changed and extra files. Returns the manifest when they agree."""
    manifest = manifest if manifest is not None else read_manifest()
    root = Path(root) if root is not None else stdlib_root()
    here = scan(root)
    problems = []
    if (here.implementation, here.python) != (manifest.implementation, manifest.python):
        problems.append(f"Python version: manifest written with {manifest.implementation} {manifest.python}, "
                        f"this interpreter is {here.implementation} {here.python} ({sys.executable})")
    want = {f.path: f for f in manifest.files}
    have = {f.path: f for f in here.files}
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    changed = sorted(p for p in set(want) & set(have) if want[p].sha256 != have[p].sha256)

    def listing(kind, paths):
        shown = ", ".join(paths[:max_listed]) + (f", ... ({len(paths) - max_listed} more)" if len(paths) > max_listed else "")
        return f"{len(paths)} {kind}: {shown}"

    for kind, paths in (("missing files", missing), ("changed files", changed), ("extra files", extra)):
        if paths:
            problems.append(listing(kind, paths))
    if problems:
        raise CorpusMismatch(
            f"the stdlib at {root} does not match the corpus manifest:\n  - " + "\n  - ".join(problems) +
            "\nTrain and evaluate with the interpreter that wrote the manifest (the project's .venv); "
            "rewriting the manifest (`python -m train.corpus --write-manifest`) changes the corpus, "
            "so models trained on the old one are no longer comparable.")
    return manifest


def read_text(root: Path, f: CorpusFile) -> str:
    data = (Path(root) / f.path).read_bytes()
    if hashlib.sha256(data).hexdigest() != f.sha256:
        raise CorpusMismatch(f"{Path(root) / f.path}: content changed since the manifest was written")
    return data.decode("utf-8")


def iter_texts(split: str, manifest: Manifest | None = None, root: Path | None = None,
               max_files: int | None = None) -> Iterator[str]:
    """Texts of one split in manifest (sorted path) order; `max_files` keeps the first few
    (tests). Call `check()` first: this only verifies the files it reads."""
    manifest = manifest if manifest is not None else read_manifest()
    root = Path(root) if root is not None else stdlib_root()
    for f in manifest.split(split)[:max_files]:
        yield read_text(root, f)


def long_context_files(manifest: Manifest | None = None, n: int = 16, split: str = "test") -> list[CorpusFile]:
    """The `n` longest files of a split (the test split by default), longest first: prompts of 1k-8k tokens."""
    manifest = manifest if manifest is not None else read_manifest()
    return sorted(manifest.split(split), key=lambda f: (-f.n_bytes, f.path))[:n]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write-manifest", action="store_true", help="scan this stdlib and write the manifest")
    mode.add_argument("--check", action="store_true", help="verify this stdlib against the manifest")
    ap.add_argument("--manifest", type=Path, default=MANIFEST_PATH)
    ap.add_argument("--root", type=Path, default=None, help="corpus root (default: this interpreter's stdlib)")
    args = ap.parse_args(argv)
    if args.write_manifest:
        m = scan(args.root)
        write_manifest(m, args.manifest)
    else:
        try:
            m = check(read_manifest(args.manifest), args.root)
        except CorpusMismatch as e:
            sys.exit(f"error: {e}")
    sizes = {s: (len(m.split(s)), sum(f.n_bytes for f in m.split(s))) for s in SPLITS}
    skipped = [f.path for f in m.files if f.split == SKIPPED]
    print(f"{'wrote' if args.write_manifest else 'ok:'} {args.manifest} ({m.implementation} {m.python}): " +
          ", ".join(f"{s} {n} files / {b / 1e6:.1f} MB" for s, (n, b) in sizes.items()) +
          f"; skipped (not UTF-8): {len(skipped)} {skipped}")


if __name__ == "__main__":
    main()
