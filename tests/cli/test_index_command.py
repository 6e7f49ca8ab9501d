"""``specdec index``'s store names (:mod:`specdec.cli.index`): ``--name`` is a name, the store
``<cache>/datastores/NAME.npz``, never a path; ``--output`` writes a file; and a store that is
missing is hinted with the option that builds it where it was looked for."""

from __future__ import annotations

import pytest

from specdec.cli import commands, index
from specdec.datastore import Datastore, open_store, store_path
from helpers import assert_one_line_error


class Bytes:  # a tokenizer: one id per byte
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode())}

    def __len__(self):
        return 256


@pytest.fixture
def docs(tmp_path, monkeypatch):
    monkeypatch.setattr(index, "load_tokenizer", lambda name, cache_dir: Bytes())
    folder = tmp_path / "work" / "here" / "docs"
    folder.mkdir(parents=True)
    (folder / "a.txt").write_text("hello world\n")
    monkeypatch.chdir(folder.parent)
    return folder


@pytest.mark.parametrize("name, why", [
    ("../../x", "is a path, not a name"),
    ("sub/x", "is a path, not a name"),
    ("..", "starts with a dot"),
    (".hidden", "starts with a dot"),
    ("docs.npz", "ends in .npz"),
    ("", "is empty"),
])
def test_a_name_that_is_not_a_plain_name_is_refused_and_nothing_is_written(docs, tmp_path, capsys, name, why):
    cache = tmp_path / "cache"
    code = commands.run(["index", str(docs), "--name", name, "--cache-dir", str(cache)])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert_one_line_error(err, contains=f"--name {name!r} {why}")
    assert "--output FILE.npz" in err.splitlines()[1]
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p.parent.name != "docs"]
    assert written == []


def test_a_plain_name_goes_to_the_cache_and_the_default_name_is_the_folders(docs, tmp_path, capsys):
    cache = tmp_path / "cache"
    assert commands.run(["index", str(docs), "--name", "my_docs-2", "--cache-dir", str(cache)]) == 0
    assert Datastore.load(cache / "datastores" / "my_docs-2.npz").documents == 1
    hidden = docs.parent / ".notes.npz"
    hidden.mkdir()
    (hidden / "b.txt").write_text("more text\n")
    assert commands.run(["index", str(hidden), "--cache-dir", str(cache)]) == 0
    assert "--datastore notes\n" in capsys.readouterr().err
    assert Datastore.load(cache / "datastores" / "notes.npz").documents == 1


def test_output_writes_the_file_and_says_how_datastore_names_it(docs, capsys):
    assert commands.run(["index", str(docs), "--output", "store"]) == 0
    assert "--datastore ./store\n" in capsys.readouterr().err
    assert open_store("./store").documents == 1


def test_a_missing_store_is_hinted_with_the_option_that_builds_it_there(tmp_path):
    with pytest.raises(ValueError, match=r"build one with 'specdec index PATH\.\.\. --name nowhere'$"):
        open_store("nowhere", cache_dir=tmp_path)
    path = tmp_path / "elsewhere.npz"
    with pytest.raises(ValueError, match=rf"build one with 'specdec index PATH\.\.\. --output {path}'$"):
        open_store(str(path))
    assert store_path(str(path)) == path
