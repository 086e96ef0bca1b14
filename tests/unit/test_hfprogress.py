"""transformers' progress bars while a worker builds or loads a model: off, then as they were."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sits_queue.cache import hfprogress
from sits_queue.cache.engines import engine_from_path
from sits_queue.models import tiny


@pytest.fixture
def bars_on() -> Iterator[None]:
    """Bars on, as transformers starts without HF_HUB_DISABLE_PROGRESS_BARS; the
    process's own setting back after."""
    was = hfprogress.bars_on()
    hfprogress.set_bars(True)
    yield
    hfprogress.set_bars(was)


def test_building_and_loading_a_model_draws_no_bar(bars_on: None, tmp_path: Path,
                                                   capfd: pytest.CaptureFixture[str]) -> None:
    # Given bars on (in a pool child, each redraw was a WARNING line of the worker's log)
    path = tiny.build_tiny_causal_lm(tmp_path / "lm", seed=0, n_positions=32)
    # When the engine loader reads it
    engine_from_path("lm", path, "cpu")
    # Then neither the build nor the load drew, and bars are on again for the user's code
    err = capfd.readouterr().err
    assert "Writing model shards" not in err
    assert "Loading weights" not in err
    assert hfprogress.bars_on()


def test_bars_already_off_stay_off(bars_on: None) -> None:
    hfprogress.set_bars(False)
    with hfprogress.quiet():
        assert not hfprogress.bars_on()
    assert not hfprogress.bars_on()


def test_a_load_that_raises_turns_the_bars_back_on(bars_on: None) -> None:
    with pytest.raises(OSError, match="no checkpoint"), hfprogress.quiet():
        assert not hfprogress.bars_on()
        raise OSError("no checkpoint")
    assert hfprogress.bars_on()
