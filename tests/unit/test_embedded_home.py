"""Where the embedded Redis keeps its data when the user has no home, as in a container
run as a uid with no passwd entry and no HOME: ``sitsq`` says so in one line (it printed
platformdirs's RuntimeError as a traceback)."""

from __future__ import annotations

import pwd
from pathlib import Path

import pytest
from click.testing import CliRunner

from sits_queue import cli, embeddedfiles
from sits_queue.errors import SitsError


@pytest.fixture
def homeless(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HOME", "USER", "LOGNAME", "XDG_DATA_HOME", "SITS_REDIS_URL", "SITS_CONFIG"):
        monkeypatch.delenv(name, raising=False)

    def no_entry(uid: int) -> pwd.struct_passwd:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)


@pytest.mark.usefixtures("homeless")
@pytest.mark.parametrize("command", [["status"], ["redis-url"], ["stop-redis"]])
def test_sitsq_without_a_home_says_what_to_set_in_one_line(command: list[str]) -> None:
    out = CliRunner().invoke(cli.main, command)
    assert out.exit_code == 1 and out.exception is not None
    assert isinstance(out.exception, SystemExit), out.exception  # (not a traceback)
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: no place for the embedded Redis"), (
        out.output)
    assert "HOME is unset" in lines[0] and "SITS_REDIS_URL" in lines[0]


def test_a_relative_home_is_refused_not_used_under_the_cwd(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # (what platformdirs before it raised returned without a home: "~" unexpanded)
    monkeypatch.setattr(embeddedfiles.platformdirs, "user_data_dir",
                        lambda _app: "~/.local/share/sits-queue")
    monkeypatch.setenv("HOME", "~")
    with pytest.raises(SitsError, match="HOME='~' is not an absolute path"):
        embeddedfiles.default_data_dir()


def test_a_home_gives_its_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr(embeddedfiles.platformdirs, "user_data_dir",
                        lambda app: str(tmp_path / app))
    assert embeddedfiles.default_data_dir() == tmp_path / "sits-queue" / "redis"
