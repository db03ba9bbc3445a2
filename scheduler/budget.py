"""The token budget of one step."""

from __future__ import annotations


class TokenBudget:
    """Tokens left in this step."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    @property
    def left(self) -> int:
        return self.limit - self.used

    def take(self, n: int) -> None:
        self.used += n
