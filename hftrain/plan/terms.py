"""The registry of the planner's axis terms (``hftrain.plan.axis_term.AxisTerm``): one line per axis beyond tp, pp
and dp, each term defined in its own module.

The order is the order the terms add their communication to a row (each adds bytes to ``row.comm``'s links);
where a row lists the axes (its label, its strategy options, ``--json``), the order follows
``hftrain.parallel.axes.AXIS_SPECS`` and the axes' traits instead.
"""

from __future__ import annotations

import hftrain.plan.context_parallel as context_parallel
import hftrain.plan.expert_parallel as expert_parallel
from hftrain.parallel.axes import AXIS_SPECS
from hftrain.plan.axis_term import AxisTerm

TERMS: tuple[AxisTerm, ...] = (expert_parallel.TERM, context_parallel.TERM)
BY_AXIS = {term.axis: term for term in TERMS}
IN_AXIS_ORDER = tuple(BY_AXIS[spec.name] for spec in AXIS_SPECS if spec.name in BY_AXIS)
"""The terms in the axes' declared order (``AXIS_SPECS``): how a row lists them."""
