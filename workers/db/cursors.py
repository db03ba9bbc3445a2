"""Listing cursors (OpenAI's `after`): what a listing raises for one naming nothing of its tenant's."""

from __future__ import annotations


class UnknownCursor(ValueError):
    """A listing's `after` names nothing of this tenant's (a listing that silently started over would repeat
    pages)."""
