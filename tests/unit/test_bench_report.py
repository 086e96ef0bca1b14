"""A benchmark's ``--json`` file: refused in one line before the run when it cannot be, and
in one line after it when writing it fails (the results are on stdout by then)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from sits_queue import cli
from sits_queue.bench import ab
from sits_queue.bench.report import check_json_path, emit

#: Over the 255-byte limit of a file name on Linux (and most file systems).
_LONG_NAME = "r" * 300 + ".json"


def test_a_file_name_too_long_is_refused_with_its_reason(tmp_path: Path) -> None:
    path = tmp_path / _LONG_NAME
    with pytest.raises(ValueError, match="File name too long") as refused:
        check_json_path(path)
    said = str(refused.value)
    assert said.startswith(f"cannot write {str(path)[:20]}")  # names the path, shortened
    assert str(path) not in said and len(said) < 200  # not a screenful of r's
    assert f"({len(str(path))} characters)" in said


def test_a_file_name_too_long_is_a_usage_error_of_sitsq_and_of_the_module(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    monkeypatch.setattr(ab, "run", lambda **_: pytest.fail("ran with a bad --json"))
    path = str(tmp_path / _LONG_NAME)
    out = CliRunner().invoke(cli.main, ["bench", "ab", "--quick", "--json", path])
    assert out.exit_code == 2, out.output
    assert "File name too long" in out.output and "Traceback" not in out.output
    with pytest.raises(SystemExit) as exited:
        ab.main(["--quick", "--json", path])
    assert exited.value.code == 2
    assert "File name too long" in capsys.readouterr().err


def test_a_place_no_file_can_be_made_is_refused_before_the_run(tmp_path: Path) -> None:
    """(os.access said yes to root in /proc: the whole run went, then the write failed)"""
    with pytest.raises(ValueError, match=r"/proc/sits-no-such\.json is not writable: "):
        check_json_path(Path("/proc/sits-no-such.json"))
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=rf"^{a_file} is not a directory$"):  # not "missing"
        check_json_path(a_file / "out.json")
    # the check writes nothing: no file left where it looked, none changed
    assert check_json_path(tmp_path / "new.json") == tmp_path / "new.json"
    assert check_json_path(a_file) == a_file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
    assert a_file.read_text() == "x"


def test_emit_ends_in_one_line_when_the_file_cannot_be_written(
        capsys: pytest.CaptureFixture[str]) -> None:
    # /proc takes no new files (and as root, check_json_path's access() test passes there)
    path = Path("/proc/sits-no-such.json")
    with pytest.raises(SystemExit) as exited:
        emit("table", {"a": 1}, path)
    said = str(exited.value.code)
    assert said.startswith(f"Error: cannot write the JSON result to {path}: ")
    assert "printed to stdout" in said and "\n" not in said
    assert '"a": 1' in capsys.readouterr().out  # the results were not lost


def _stub_ab(monkeypatch: pytest.MonkeyPatch, doomed: Path) -> None:
    """ab's run and table stood in for; the run removes ``doomed`` (a folder gone mid-run)."""
    def run(**_: Any) -> dict[str, Any]:
        shutil.rmtree(doomed)
        return {"systems": {}}

    monkeypatch.setattr(ab, "run", run)
    monkeypatch.setattr(ab, "table", lambda result: "table")


def test_a_folder_gone_mid_run_is_one_line_from_sitsq(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    # Given a --json folder that exists when checked, and is removed during the run
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    _stub_ab(monkeypatch, out_dir)
    # When the benchmark ends, then one line names the path and the OS's reason
    out = CliRunner().invoke(cli.main, ["bench", "ab", "--quick",
                                        "--json", str(out_dir / "r.json")])
    assert out.exit_code == 1, out.output
    assert "Traceback" not in out.output and out.exception is not None
    (line,) = [x for x in out.output.splitlines() if x.startswith("Error: ")]
    # (the path whole, or its start and end when it is long: pytest's tmp paths vary)
    assert line.startswith("Error: cannot write the JSON result to /")
    assert "r.json" in line and line.endswith(
        ": No such file or directory (the results were printed to stdout)")
    assert "table" in out.output


def test_a_folder_gone_mid_run_is_one_line_from_the_module(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    _stub_ab(monkeypatch, out_dir)
    with pytest.raises(SystemExit) as exited:
        ab.main(["--quick", "--json", str(out_dir / "r.json")])
    assert str(exited.value.code).startswith("Error: cannot write the JSON result to ")
    assert "table" in capsys.readouterr().out
