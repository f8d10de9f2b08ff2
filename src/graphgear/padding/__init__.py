"""Gear padding: a size between gears runs at the next gear up on zero-padded inputs,
its outputs sliced back. :mod:`.hazards` is the static check of where that would change
real results; :mod:`.call` the padded call (and the padded backward) the pipeline
composes with the dispatch when ``inference_config.gear_padding`` is on;
:mod:`.outputs` which output dims are sliced back, and which cannot be."""

from .call import GetKey, PaddedBackward, PaddedCall
from .hazards import PaddingHazard, RowWrite, padding_checks, padding_hazards
from .outputs import UnsliceableDim, output_specs, slice_outputs, unsliceable_outputs

__all__ = ["GetKey", "PaddedBackward", "PaddedCall", "PaddingHazard", "RowWrite", "UnsliceableDim", "output_specs",
           "padding_checks", "padding_hazards", "slice_outputs", "unsliceable_outputs"]
