"""One error type whose message says where, what was wrong, and what was received."""

from __future__ import annotations

__all__ = ["TileError", "TileIndexError", "check"]


class TileError(ValueError):
    """``[where] what was wrong; received: what``."""

    def __init__(self, where: str, what: str, received: str | None = None):
        self.where, self.what, self.received = where, what, received
        msg = f"[{where}] {what}"
        if received is not None:
            msg += f"; received: {received}"
        super().__init__(msg)

    def __reduce__(self):
        # pickled (a worker's error on its way to the client, multiprocessing) by the arguments
        # it was made with, and its other attributes (a subclass's) as its state: the default
        # rebuilds it from the message alone, which fails ("missing 'what'")
        return type(self), (self.where, self.what, self.received), dict(self.__dict__)


class TileIndexError(TileError, IndexError):
    """An index out of range, or more indices than dims: an IndexError (as torch's and NumPy's),
    so that ``for row in x`` and code that catches IndexError behave as they do with arrays."""


def check(cond: bool, where: str, what: str, received: str | None = None) -> None:
    if not cond:
        raise TileError(where, what, received)
