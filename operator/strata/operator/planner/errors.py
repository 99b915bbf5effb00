"""Typed planning errors: each names what is wrong in words a person can act on.

A shortfall (the pool is too small) is not an error: it is a result, carried in the Plan. These are for requests
the planner refuses: malformed cluster objects, options out of range, and overrides that cannot be honoured.
"""

from __future__ import annotations


class PlanningError(Exception):
    """Base of every error the planner raises."""


class InvalidInventoryError(PlanningError):
    """A Node or Pod object the planner cannot read (a malformed quantity, a missing name)."""


class InvalidOptionError(PlanningError):
    """An option outside its range (parallel 0, a negative headroom)."""


class OverrideDoesNotFitError(PlanningError):
    """A user override (context, max stages) that no plan can honour; the message says what would fit."""
