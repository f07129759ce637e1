"""One error type whose message says where, what was wrong, and what was received."""

from __future__ import annotations

__all__ = ["TileError", "check"]


class TileError(ValueError):
    """``[where] what was wrong; received: what``."""

    def __init__(self, where: str, what: str, received: str | None = None):
        self.where, self.what, self.received = where, what, received
        msg = f"[{where}] {what}"
        if received is not None:
            msg += f"; received: {received}"
        super().__init__(msg)


def check(cond: bool, where: str, what: str, received: str | None = None) -> None:
    if not cond:
        raise TileError(where, what, received)
