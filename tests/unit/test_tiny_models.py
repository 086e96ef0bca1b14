"""The tiny-model builders (``models/tiny.py``) at a path that already holds something."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sits_queue.models import tiny


def test_a_directory_of_the_users_own_is_not_replaced(tmp_path: Path) -> None:
    """(README shows the builders to users: a path holding their own model was deleted
    and the tiny one written there)"""
    own = tmp_path / "lm"
    own.mkdir()
    (own / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="is no tiny model built here"):
        tiny.build_tiny_causal_lm(own)
    assert (own / "config.json").read_text() == "{}"
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"x")
    with pytest.raises(FileExistsError):
        tiny.build_tiny_encoder(a_file)
    assert a_file.read_bytes() == b"x"


def test_a_tiny_model_of_another_spec_is_rebuilt_and_one_of_the_same_kept(
        tmp_path: Path) -> None:
    path = tiny.build_tiny_causal_lm(tmp_path / "lm", seed=1)
    stamp = (path / tiny.MARKER).stat().st_mtime_ns
    assert tiny.build_tiny_causal_lm(tmp_path / "lm", seed=1) == path
    assert (path / tiny.MARKER).stat().st_mtime_ns == stamp  # kept as it was
    tiny.build_tiny_causal_lm(tmp_path / "lm", seed=2)
    assert json.loads((path / tiny.MARKER).read_text())["seed"] == 2
    # and an empty directory is no one's model: built there
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (tiny.build_tiny_encoder(empty) / tiny.MARKER).exists()


def test_builders_racing_to_replace_an_older_build_never_take_it_for_a_users_own(
        tmp_path: Path) -> None:
    """(a builder deleting an older build in place left it without its marker for a
    moment: another process building the same new spec, as every process of an app that
    builds at import does after an upgrade, read it as the user's own and refused it)"""
    import threading

    def write(tmp: Path) -> None:
        for i in range(50):  # (enough files that a deletion takes a while)
            (tmp / f"shard-{i}").write_bytes(b"w" * 1000)

    path, errors = tmp_path / "lm", []

    def build(round_: int) -> None:
        try:
            assert tiny._build(path, {"kind": "stub", "round": round_}, write) == path
        except Exception as exc:  # (any of them fails the test below)
            errors.append(exc)

    for round_ in range(1, 16):
        tiny._build(path, {"kind": "stub", "round": -round_}, write)  # the older build
        threads = [threading.Thread(target=build, args=(round_,)) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert tiny._built_with(path) == {"kind": "stub", "round": round_,
                                          "version": tiny.BUILD_VERSION}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lm"]  # nothing left aside
