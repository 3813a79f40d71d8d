"""The ``parallelism`` options reach ``hftrain.parallel`` by an explicit table (issue 56: ``taken_by`` matched them by
parameter name, so a renamed keyword silently dropped its option).

For every entry point in ``hftrain.strategies.megatron.plugin.OPTIONS_TAKEN``, the options named are exactly the
section's fields the function takes as keywords: a keyword renamed on the function (the option would be dropped) or a
new option the function takes but the table forgets both fail here; and a name that is not a field fails the call.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import hftrain.parallel as parallel
from hftrain.config import ParallelismConfig
from hftrain.strategies.megatron.plugin import OPTIONS_TAKEN, options_for


@pytest.mark.parametrize("name", sorted(OPTIONS_TAKEN))
def test_each_entry_point_takes_exactly_the_options_its_table_names(name):
    function = getattr(parallel, name)
    fields = {f.name for f in dataclasses.fields(ParallelismConfig)}
    keywords = set(inspect.signature(function).parameters)
    assert set(OPTIONS_TAKEN[name]) <= keywords, f"{name} no longer takes {set(OPTIONS_TAKEN[name]) - keywords}"
    assert keywords & fields == set(OPTIONS_TAKEN[name]), f"{name} takes {keywords & fields - set(OPTIONS_TAKEN[name])}"
    options = options_for(ParallelismConfig(sequence_parallel=True, cp_comm="all_to_all"), function)
    assert set(options) == set(OPTIONS_TAKEN[name])
    assert options.get("sequence_parallel", True) is True and options.get("cp_comm", "all_to_all") == "all_to_all"


def test_a_name_that_is_no_option_fails():
    with pytest.raises(AttributeError, match="no option comm"):
        ParallelismConfig().named(("comm",))
