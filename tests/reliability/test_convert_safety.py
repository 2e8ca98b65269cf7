"""`fusedkv convert SRC DST` never loses data: a non-empty DST is refused without --overwrite, and DST
is written through a temporary directory and a rename, so a failed conversion leaves it as it was."""

from __future__ import annotations

import shutil

from tests.reliability.conftest import assert_one_line_error


def snapshot(path):
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_convert_into_a_new_directory(cli, qwen3_src, tmp_path):
    r = cli("convert", qwen3_src, tmp_path / "new" / "dst", "--kv-sharing", "fusedkv")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "new" / "dst" / "model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["dst"]  # no temporary left behind


def test_non_empty_destination_is_refused_without_overwrite(cli, qwen3_src, tiny_ckpt, tmp_path):
    """Was: a trained model in DST silently replaced."""
    dst = tmp_path / "trained"
    shutil.copytree(tiny_ckpt, dst)
    before = snapshot(dst)
    assert_one_line_error(cli("convert", qwen3_src, dst), 2, f"destination {dst} already holds files", "--overwrite")
    assert snapshot(dst) == before
    r = cli("convert", qwen3_src, dst, "--overwrite")
    assert r.returncode == 0, r.stderr
    after = snapshot(dst)
    assert after != before and b'"qwen3"' not in after[next(k for k in after if k.name == "config.json")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trained"]


def test_an_empty_destination_needs_no_overwrite(cli, qwen3_src, tmp_path):
    (tmp_path / "empty").mkdir()
    assert cli("convert", qwen3_src, tmp_path / "empty").returncode == 0


def test_failed_conversion_with_overwrite_leaves_the_destination_as_it_was(cli, qwen3_src, tiny_ckpt, tmp_path):
    broken = tmp_path / "broken-src"
    shutil.copytree(qwen3_src, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors at all")
    dst = tmp_path / "trained"
    shutil.copytree(tiny_ckpt, dst)
    before = snapshot(dst)
    r = cli("convert", broken, dst, "--overwrite")
    assert r.returncode in (1, 2) and "Traceback" not in r.stderr, r.stderr
    assert snapshot(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken-src", "trained"]


def test_destination_that_is_a_file_or_the_source(cli, qwen3_src, bad_files, tmp_path):
    assert_one_line_error(cli("convert", qwen3_src, bad_files["random.bin"]), 2, "is a file")
    src = tmp_path / "src"
    shutil.copytree(qwen3_src, src)
    assert_one_line_error(cli("convert", src, src, "--overwrite"), 2, "would replace the source")
    assert_one_line_error(cli("convert", src, tmp_path, "--overwrite"), 2, "would replace the source")  # its parent
    assert (src / "config.json").is_file()


def test_source_that_is_not_a_qwen3_checkpoint(cli, tiny_ckpt, bad_files, tmp_path):
    assert_one_line_error(cli("convert", tiny_ckpt, tmp_path / "o1"), 2, "only a vanilla")  # K/V already dropped
    assert_one_line_error(cli("convert", bad_files["random.bin"], tmp_path / "o2"), 2, "no config.json")
    assert_one_line_error(cli("convert", bad_files["missing"], tmp_path / "o3"), 2, "no config.json")
    assert_one_line_error(cli("convert", "", tmp_path / "o4"), 2, "argument src: must not be empty")
    assert not any(tmp_path.iterdir())


def test_bad_plan_is_refused_before_anything_is_written(cli, qwen3_src, tmp_path):
    assert_one_line_error(cli("convert", qwen3_src, tmp_path / "o", "--kv-sharing", "bogus"), 2, "unknown plan 'bogus'")
    assert not (tmp_path / "o").exists()


def test_full_disk_names_the_destination_and_leaves_nothing(cli, qwen3_src, full_disk):
    """Was: a raw safetensors error and a half-written DST."""
    dst = full_disk / "dst"
    line = assert_one_line_error(cli("convert", qwen3_src, dst), 1, "no space left on the device", str(dst))
    assert "nothing was changed" in line
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler"]
