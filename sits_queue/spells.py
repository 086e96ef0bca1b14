"""A failure that repeats at every call (a driver refusing a call, a broken source read at
every pick) said once while it lasts: at its level the first time, at debug after, until
a success ends the spell and the next failure is said again."""

from __future__ import annotations

import logging
from typing import Any


class Spell:
    """One kind of failure of one caller, and whether it is said already."""

    def __init__(self, logger: logging.Logger, level: int = logging.WARNING) -> None:
        self._logger, self._level = logger, level
        self.on = False

    def failed(self, message: str, *args: Any, exc_info: bool = False) -> None:
        """Say the failure (the first of a spell at its level, with ``exc_info``'s
        traceback; the rest at debug, without)."""
        if self.on:
            self._logger.debug(message, *args)
        else:
            self._logger.log(self._level, message, *args, exc_info=exc_info)
        self.on = True

    def over(self) -> None:
        """The call succeeded: a failure after this is said again."""
        self.on = False
