"""What every config section shares: the frozen, strict pydantic base class (unknown keys and changes after
construction are errors, defaults are validated too) and :class:`ConfigError`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration problem, with the dotted key and what is allowed."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)
