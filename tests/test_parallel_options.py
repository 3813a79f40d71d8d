"""The ``parallelism`` options reach ``hftrain.parallel`` by name, each axis's module naming the fields it reads
(``AxisOps.options``, with their defaults) (issue 56: ``taken_by`` matched them by parameter name, so a renamed
keyword silently dropped its option).

Every option an axis reads is a field of the section with the same default; every field an axis's metadata assigns
reaches an axis, or the pipeline runtime's options; a name no axis reads fails a hand-written call, a name that is no
field fails the section.
"""

from __future__ import annotations

import dataclasses

import pytest

from hftrain.config import ParallelismConfig
from hftrain.parallel.axis_ops import declared, option_defaults, with_defaults
from hftrain.strategies.megatron.pipeline_runtime import PipelineOptions
from hftrain.strategies.megatron.plugin import axis_options


def test_each_axis_reads_fields_of_the_section_with_their_defaults():
    fields = {f.name: f for f in dataclasses.fields(ParallelismConfig)}
    default = ParallelismConfig()
    for spec, ops in declared():
        for name, value in ops.options.items():
            assert name in fields, f"{spec.name} reads {name}, which is no parallelism field"
            assert getattr(default, name) == value, f"{spec.name}'s default for {name} is not the schema's"
    read = set(option_defaults()) | {f.name for f in dataclasses.fields(PipelineOptions)}
    assigned = {name for name, f in fields.items() if f.metadata.get("axis")}
    assert assigned <= read, f"fields no axis reads: {sorted(assigned - read)}"


def test_the_section_passes_every_option_by_name():
    section = ParallelismConfig(sequence_parallel=True, cp_comm="all_to_all", vocab_multiple=8)
    options = axis_options(section)
    assert set(options) == set(option_defaults())
    assert options["sequence_parallel"] is True and options["cp_comm"] == "all_to_all"
    assert options["vocab_multiple"] == 8


def test_a_name_that_is_no_option_fails():
    with pytest.raises(AttributeError, match="no option comm"):
        ParallelismConfig().named(("comm",))
    with pytest.raises(TypeError, match="no parallel axis takes the option"):
        with_defaults({"comm": "ring"})
