"""The stdlib corpus: split rule, manifest, and the check that refuses a different stdlib."""
import collections
import json
import platform

import pytest

from train import corpus


def make_fake_stdlib(root):
    files = {
        "abc.py": "import os\n",
        "json/__init__.py": "def loads(s):\n    return s\n" * 20,
        "json/decoder.py": "class Decoder:\n    pass\n" * 50,
        "big.py": "x = 1\n" * 500,
        "test/data/latin1.py": None,  # not UTF-8
        "site-packages/numpy/__init__.py": "installed, not stdlib\n",
        "__pycache__/abc.cpython-311.py": "cache\n",
        "config-3.11-x86_64-linux-gnu/python-config.py": "build specific\n",
        "_sysconfigdata__linux_x86_64-linux-gnu.py": "build_time_vars = {}\n",
        "README.txt": "not python\n",
    }
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            p.write_bytes("caf\xe9 = 1\n".encode("latin-1"))
        else:
            p.write_text(text)
    return root


def test_split_is_deterministic_and_about_90_5_5():
    paths = [f"pkg{i // 50}/module_{i}.py" for i in range(20000)]
    splits = [corpus.split_of(p) for p in paths]
    assert splits == [corpus.split_of(p) for p in paths]
    frac = {s: n / len(paths) for s, n in collections.Counter(splits).items()}
    assert abs(frac["train"] - 0.90) < 0.01
    assert abs(frac["validation"] - 0.05) < 0.01
    assert abs(frac["test"] - 0.05) < 0.01
    # The real stdlib: ~1800 files, so looser bounds.
    real = collections.Counter(corpus.split_of(p) for p in corpus.list_files(corpus.stdlib_root()))
    n = sum(real.values())
    assert n > 500
    assert 0.85 < real["train"] / n < 0.95 and 0.02 < real["validation"] / n < 0.08 and 0.02 < real["test"] / n < 0.08


def test_scan_excludes_non_stdlib_and_records_non_utf8(tmp_path):
    m = corpus.scan(make_fake_stdlib(tmp_path))
    paths = {f.path: f for f in m.files}
    assert set(paths) == {"abc.py", "json/__init__.py", "json/decoder.py", "big.py", "test/data/latin1.py"}
    assert paths["test/data/latin1.py"].split == corpus.SKIPPED
    assert all(f.split == corpus.split_of(f.path) for f in m.files if f.path != "test/data/latin1.py")
    assert paths["abc.py"].n_bytes == len("import os\n")
    assert m.python == platform.python_version()


def test_manifest_roundtrip_and_check_passes(tmp_path):
    root = make_fake_stdlib(tmp_path / "lib")
    path = tmp_path / "manifest.json"
    corpus.write_manifest(corpus.scan(root), path)
    json.loads(path.read_text())  # valid JSON
    m = corpus.read_manifest(path)
    assert m == corpus.scan(root)
    assert corpus.check(m, root) == m
    texts = list(corpus.iter_texts("train", m, root))
    assert texts == [(root / f.path).read_text() for f in m.split("train")]


@pytest.mark.parametrize("change", ["modify", "delete", "add", "version"])
def test_check_names_what_differs(tmp_path, change):
    root = make_fake_stdlib(tmp_path / "lib")
    m = corpus.scan(root)
    if change == "modify":
        (root / "json/decoder.py").write_text("changed\n")
        expect = ["1 changed files", "json/decoder.py"]
    elif change == "delete":
        (root / "abc.py").unlink()
        expect = ["1 missing files", "abc.py"]
    elif change == "add":
        (root / "new_module.py").write_text("pass\n")
        expect = ["1 extra files", "new_module.py"]
    else:
        m = corpus.Manifest(python="3.0.1", implementation=m.implementation, files=m.files)
        expect = ["Python version", "3.0.1", platform.python_version()]
    with pytest.raises(corpus.CorpusMismatch) as e:
        corpus.check(m, root)
    for text in expect:
        assert text in str(e.value)


def test_reading_a_changed_file_is_refused(tmp_path):
    root = make_fake_stdlib(tmp_path / "lib")
    m = corpus.scan(root)
    f = next(f for f in m.files if f.path == "big.py")
    (root / "big.py").write_text("y = 2\n")
    with pytest.raises(corpus.CorpusMismatch, match="big.py"):
        corpus.read_text(root, f)


def test_long_context_files_are_the_longest_test_files():
    m = corpus.scan()
    longest = corpus.long_context_files(m, n=5)
    assert all(f.split == "test" for f in longest)
    sizes = [f.n_bytes for f in longest]
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[-1] >= max(f.n_bytes for f in m.split("test") if f not in longest)


def test_committed_manifest_matches_this_interpreter():
    m = corpus.read_manifest()
    if (m.implementation, m.python) != (platform.python_implementation(), platform.python_version()):
        # Another interpreter: the check must say so rather than mix another stdlib in.
        with pytest.raises(corpus.CorpusMismatch, match=m.python):
            corpus.check(m)
        return
    corpus.check(m)
    counts = collections.Counter(f.split for f in m.files)
    assert counts["train"] > 1000 and counts["validation"] > 40 and counts["test"] > 40
