"""What a new user meets first on the command line: ``make-data`` on a folder made before,
``make-shards`` with a wrong or an occupied path, ``--help`` and ``--version``. Run as a user
runs them (a subprocess) where the terminal's text is the point."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import aioload
from aioload._shards.index import SIDECAR
from aioload._tools import cli as _cli

ROOT = Path(__file__).resolve().parent.parent


def aioload_cli(*args, cache, python_args=()) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), AIOLOAD_CACHE=str(cache))
    return subprocess.run([sys.executable, *python_args, "-m", "aioload", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode != 0 and done.stdout == "", done.stdout + done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    return done.stderr


# -- make-data ----------------------------------------------------------------------------------
def jpegs(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): p.stat().st_mtime_ns for p in root.rglob("*.jpg")}


def test_make_data_grows_and_cuts_a_folder_made_before(tmp_path, capsys):
    target = tmp_path / "photos"
    assert _cli.main(["make-data", str(target), "--images", "6", "--classes", "3"]) == 0
    six = jpegs(target)
    capsys.readouterr()
    assert _cli.main(["make-data", str(target), "--images", "9", "--classes", "3"]) == 0
    grown = capsys.readouterr()
    assert grown.out.endswith(f"9 JPEGs in 3 class folders under {target} (it held 6)\n")
    assert grown.err.splitlines()[-1] == "  generated 3/3 images"  # the three it wrote
    nine = jpegs(target)
    assert len(nine) == 9 and {k: nine[k] for k in six} == six  # the first six are kept, not rewritten
    assert len(aioload.ImageFolder(target)) == 9
    # a folder made at once with 9 holds the same files
    fresh = aioload.make_data(tmp_path / "fresh", 9, classes=3)
    assert all((target / k).read_bytes() == (fresh / k).read_bytes() for k in nine)
    assert _cli.main(["make-data", str(target), "--images", "4", "--classes", "3"]) == 0
    cut = capsys.readouterr()
    assert cut.out.endswith(f"4 JPEGs in 3 class folders under {target} (it held 9)\n")
    assert cut.err == "  removed 5 images, past the 4 asked for\n"  # and nothing said to be generated
    assert sorted(jpegs(target)) == sorted(k for k in nine if int(k[-10:-4]) < 4)
    assert _cli.main(["make-data", str(target), "--images", "4", "--classes", "3"]) == 0
    assert capsys.readouterr().out == f"{target} already holds these 4 generated JPEGs: nothing to do\n"


def test_make_data_refuses_other_classes_or_seed_in_a_folder_made_before(tmp_path):
    target = tmp_path / "photos"
    aioload.make_data(target, 6, classes=3)
    before = jpegs(target)
    err = one_line_error(aioload_cli("make-data", str(target), "--images", "6", "--classes", "2", cache=tmp_path))
    assert err == (f"error: aioload make-data: {target} holds 6 generated JPEGs made with classes=3, seed=0, not "
                   f"classes=2, seed=0: make these in another folder, or delete {target} first\n")
    assert jpegs(target) == before


# -- bench --------------------------------------------------------------------------------------
LAYOUT = "class folders of images (DIR/CLASS/IMAGE.jpg, as ImageFolder reads them)"


def test_bench_on_a_missing_or_wrong_folder_is_one_line_naming_it(tmp_path):
    missing = tmp_path / "nope"
    err = one_line_error(aioload_cli("bench", "--data", str(missing), cache=tmp_path))
    assert err == (f"error: aioload bench: --data {missing} is not a folder: give it {LAYOUT}, or leave --data out "
                   "for generated JPEGs\n")
    parquet = tmp_path / "pq"
    parquet.mkdir()
    (parquet / "train-0.parquet").write_bytes(b"PAR1")
    err = one_line_error(aioload_cli("bench", "--data", str(parquet), cache=tmp_path))
    assert err == (f"error: aioload bench: --data {parquet} holds Parquet files, and aioload bench reads {LAYOUT}; "
                   "python benchmarks/parquet.py measures Parquet, or aioload make-data DIR writes a folder to "
                   "measure\n")
    (tmp_path / "empty" / "cat").mkdir(parents=True)
    err = one_line_error(aioload_cli("bench", "--data", str(tmp_path / "empty"), cache=tmp_path))
    assert err.startswith(f"error: aioload bench: --data {tmp_path / 'empty'}: found no valid file for the classes "
                          "cat. Supported extensions are: .jpg") and err.endswith(f"; aioload bench reads {LAYOUT}\n")


# -- make-shards --------------------------------------------------------------------------------
def test_make_shards_from_a_missing_folder_is_one_line_naming_it(tmp_path):
    err = one_line_error(aioload_cli("make-shards", str(tmp_path / "nope"), str(tmp_path / "out"), cache=tmp_path))
    assert err == (f"error: aioload make-shards: {tmp_path / 'nope'} is not a folder: SRC is a class-per-folder tree "
                   "(SRC/CLASS/IMAGE.jpg, as ImageFolder reads it)\n")
    assert not (tmp_path / "out").exists()


def test_make_shards_refuses_an_occupied_folder_unless_overwrite(image_root, tmp_path):
    out = tmp_path / "out"
    assert aioload_cli("make-shards", str(image_root), str(out), "--maxcount", "20", cache=tmp_path).returncode == 0
    before = sorted(p.name for p in out.iterdir())
    assert len(before) == 6  # 3 shards and their sidecars
    err = one_line_error(aioload_cli("make-shards", str(image_root), str(out), "--maxcount", "30", cache=tmp_path))
    assert err.startswith(f"error: aioload make-shards: {out} is not empty (6 entries, such as train-000000.tar): ")
    assert err.endswith("pass --overwrite to remove the shards there first\n")
    assert sorted(p.name for p in out.iterdir()) == before
    done = aioload_cli("make-shards", str(image_root), str(out), "--maxcount", "30", "--overwrite", "--name", "b",
                       cache=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"removed 6 old shard files (shards and their index sidecars) from {out}"
    assert sorted(p.name for p in out.iterdir()) == [f"b-{i:06d}.tar{s}" for i in range(2) for s in ("", SIDECAR)]
    ds = aioload.WebDataset(sorted(str(p) for p in out.glob("*.tar")), index_cache=False)
    keys = [ds.key(i) for i in range(len(ds))]
    assert len(keys) == len(set(keys)) == 48


# -- help, version, wording ---------------------------------------------------------------------
LOADS_NOTHING = """
import sys
from aioload._tools.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    print("exit", exc.code)
heavy = sorted(m for m in ("torch", "torchvision", "numpy", "PIL") if m in sys.modules)
print("imported", heavy)
"""


def test_help_and_version_answer_without_importing_torch(tmp_path):
    for args, shown in ((["--help"], "usage: aioload [-h] [--version] COMMAND ..."),
                        (["--version"], f"aioload {aioload.__version__}"),
                        (["make-shards", "--help"], "usage: aioload make-shards")):
        done = subprocess.run([sys.executable, "-c", LOADS_NOTHING, *args], capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
        assert done.stdout.startswith(shown) and done.stdout.endswith("exit 0\nimported []\n"), done.stdout + done.stderr
    import importlib.metadata

    assert aioload.__version__ == importlib.metadata.version("aioload")  # pyproject.toml's


def test_messages_put_an_before_a_vowel(image_root, tmp_path):
    loader = aioload.DataLoader(aioload.ImageFolder(image_root), batch_size=4)
    with loader, pytest.raises(TypeError, match=r"this loader's dataset is an ImageFolder$"):
        loader.set_weights([1.0])
    with pytest.raises(TypeError, match=r"^sample 'k': member 'cls' is an object; give bytes"):
        with aioload.ShardWriter(str(tmp_path / "a-%06d.tar")) as writer:
            writer.write({"__key__": "k", "cls": object()})
