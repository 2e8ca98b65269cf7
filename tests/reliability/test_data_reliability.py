"""Training data that is not text: binary files are refused naming the file, non-UTF-8 errors name the
file and line, a few stray bytes are read with a warning; checked in the library and through
`fusedkv train --data`."""

from __future__ import annotations

import logging

import pytest

from fusedkv.data import JsonlSource, TextSource, read_text_file
from tests.reliability.conftest import assert_one_line_error


@pytest.mark.parametrize("name", ["random.bin", "program"])
def test_binary_files_are_refused_naming_them(bad_files, name):
    with pytest.raises(ValueError, match="does not look like text") as e:
        read_text_file(bad_files[name])
    assert str(bad_files[name]) in str(e.value)


def test_a_directory_with_one_binary_txt_names_that_file(tmp_path, bad_files):
    (tmp_path / "a.txt").write_text("plain text " * 100)
    (tmp_path / "b.txt").write_bytes(bad_files["random.bin"].read_bytes())
    with pytest.raises(ValueError, match="b.txt does not look like text"):
        list(TextSource(tmp_path))


def test_a_few_bad_bytes_are_read_with_a_warning_naming_file_and_line(bad_files, caplog):
    with caplog.at_level(logging.WARNING):
        text = read_text_file(bad_files["latin1.txt"])
    assert "caf\ufffd au lait" in text
    assert "latin1.txt" in caplog.text and "line 51" in caplog.text


def test_utf8_text_is_read_unchanged(tmp_path):
    (tmp_path / "t.txt").write_text("naïve café — ROMEO: ☃\n\tindented\r\n", encoding="utf-8")
    assert read_text_file(tmp_path / "t.txt") == "naïve café — ROMEO: ☃\n\tindented\r\n"


def test_jsonl_that_is_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "fine"}\n\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:3: not UTF-8 \(byte 0xe9 at column 14\)"):
        list(JsonlSource(path))


@pytest.mark.parametrize("name, fragment", [
    ("random.bin", "does not look like text"),
    ("program", "does not look like text"),
    ("a-directory", "contains no .txt files"),
    ("missing", "does not exist"),
    ("empty.txt", "no non-empty documents"),
])
def test_train_refuses_data_that_is_not_text(cli, bad_files, tmp_path, name, fragment):
    """Was: training ran happily on U+FFFD garbage from random bytes or an executable."""
    r = cli("train", "--preset", "nano", "--max-steps", "1", "--data", bad_files[name], "--out", tmp_path / "run",
            env={"FUSEDKV_DATA_DIR": str(tmp_path / "data")}, timeout=300)
    line = assert_one_line_error(r, 2, fragment)
    assert bad_files[name].name in line
    assert not (tmp_path / "run" / "final").exists()


def test_train_names_file_and_line_of_a_bad_jsonl(cli, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    r = cli("train", "--preset", "nano", "--max-steps", "1", "--data", path, "--out", tmp_path / "run",
            env={"FUSEDKV_DATA_DIR": str(tmp_path / "data")}, timeout=300)
    assert_one_line_error(r, 2, "d.jsonl:2: not UTF-8")
