"""Errors a user of SITS queue can catch."""

from __future__ import annotations


class SitsError(Exception):
    """Base of every error SITS queue raises on purpose."""


class ConfigError(SitsError, ValueError):
    """The configuration (file, environment or arguments) is invalid."""


class InvalidTaskOptions(SitsError, ValueError):
    """A submission named an unknown class or an invalid option; nothing was enqueued."""
