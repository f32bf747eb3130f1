"""Every refusal's code, in one table.

A ``ScheduleError`` (and ``TemporalSliceError``), a ``ResourceError`` and an option group's ``Rejection``
carry a stable, dotted ``code``: ``<area>.<reason>``.  The search counts what it prunes by these codes
(``search.space.SpaceReport.pruned``), and the search's refusals never need their sentence read, so a
report says how many candidates went for each reason.  ``tests/test_refusal_codes.py`` scans the sources:
every refusal is raised with a code, and every code raised is in this table (and every code here is
raised somewhere).

Codes are stable: a reason keeps its code while its sentence may be reworded.  Besides the table, every
knob of ``schedulers.options`` has ``<knob>.<suffix>`` codes for each of ``KNOB_SUFFIXES`` (its declared
values and the target's capabilities, checked by its group), and ``<knob>.<reason>`` for each reason its
declaration lists (``knob(refusals=...)``: the refusals of its group's own checks, declared with the knob so that
a knob and its codes are added in one place).
"""

from __future__ import annotations

import functools

#: ``<knob>.<suffix>`` codes that every knob's group gives (``schedulers.options``)
KNOB_SUFFIXES: dict[str, str] = {
    "type": "the knob's value is not of its type (a whole number, or True/False)",
    "range": "the knob's value is not one it declares (its choices or bounds)",
    "target": "the target cannot run the knob (``HardwareModel.capabilities``: wgmma needs sm_90a, tma and "
              "clusters sm_90+); refused before the search, as the space asks the groups what to offer",
}

#: code -> what it refuses (one line each), by area
REFUSALS: dict[str, str] = {
    # -- the request: tiles, dims, step (make_schedule, blocking)
    "option.unknown": "a keyword that is no knob of the option groups",
    "tile.type": "a tile that is not a whole number",
    "tile.range": "a tile not positive, or larger than its dim (and not a padded MMA row tile)",
    "tile.unknown_dim": "a tile given for a dim the graph does not have",
    "tile.not_cut": "a tile given for a dim the spatial slicer does not cut",
    "tile.padded": "a tile larger than its dim that is not a warp-tile program's row tile",
    "spatial.none": "no dim of the graph can be cut spatially",
    "thread_dim.not_cut": "the thread dim is not a spatially cut dim",
    "serial.unknown": "the serial dim is not a dim of the graph",
    "serial.none": "the graph reduces no dim that could be sliced temporally",
    "serial.unsliceable": "no reduced dim of the graph can be sliced temporally (each refused)",
    "step.type": "a step that is not a whole number",
    "step.range": "a step not positive or longer than the serial dim",
    "threads.block": "the block needs more threads than the hardware model's block allows",
    "levels.unknown_space": "a memory level given for a space the graph does not have",
    "levels.move": "a memory level the lowering cannot give that space",
    "options.need_tensor_cores": "warp-tile or Hopper knobs set on a CUDA-core (tensor_cores=False) schedule",
    # -- a schedule read from JSON (Schedule.from_json)
    "schedule.json": "the text is not valid JSON",
    "schedule.format": "not a spacefusion schedule (its format tag)",
    "schedule.malformed": "a schedule JSON with fields missing or of the wrong kind",
    "schedule.serial": "a schedule JSON whose serial dim is not a dim of its graph",
    "schedule.step": "a schedule JSON whose step is outside 1..the serial dim",
    "schedule.block_dim": "a schedule JSON whose block names a dim its graph does not have",
    "schedule.tile": "a schedule JSON whose tile is outside 1..its dim",
    "schedule.graph": "a schedule JSON whose decisions are not the slicers' for its graph",
    # -- the temporal slicer (update functions) and split reductions
    "temporal.serial_unknown": "the serial dim is not a dim of the graph",
    "temporal.no_reduction": "no op reduces over the serial dim",
    "temporal.output_keeps_serial": "an output both reduces and keeps the serial dim",
    "temporal.not_rescaling": "a carry is not the old value times a factor",
    "temporal.reduce_dependent": "an op reduces while depending on a running state",
    "temporal.cyclic": "inlining the dependent ops does not end",
    "temporal.gather_inlined": "an op that gathers or windows would be inlined into an update",
    "temporal.not_closed": "a state's body is not closed under differentiation by the running states",
    "temporal.postponed_read": "a state reads a state whose value carries a postponed factor",
    "temporal.max_reads_state": "a max reduction reads running states (a max cannot be corrected)",
    "temporal.carry_not_identity": "a carry changes the accumulator when nothing changed",
    "temporal.check_failed": "the derived updates disagree with the exact chain on random data",
    "split.dim_unknown": "the split dim is not a dim of the graph",
    "split.parts": "the split dim does not divide into the parts asked",
    "split.no_reduction": "no op reduces over the split dim",
    "split.intermediate_stream": "a state streams an intermediate (a split re-reads inputs only)",
    "split.intermediate_output": "an output reads an intermediate the second pass would recompute",
    "split.not_elementwise": "a space the partial kernel needs is not an element-wise tile of inputs",
    "split.body_span": "a state's body does not span its reduced dims",
    "split.constant_state": "a state is a constant: nothing to combine",
    "split.carry_read": "a carry reads something other than old and new values",
    "split.second_pass_dims": "the second pass iterates other dims than its output's",
    "split.tail_uncut": "no split of the reduction leaves the tail a dim to cut",
    "partition.no_fit": "an operator does not fit the hardware even alone",
    "interpreter.gather": "the schedule interpreter cannot follow an op that gathers",
    # -- the knobs' own checks: declared with each knob (``knob(refusals=...)`` in schedulers.options), see
    # ``knob_refusals``
    # -- the tensor-core forms.  A tensor-core schedule with no form is refused with its warp-tile reading's
    # code (the GEMM + epilogue reading's, ``wmma.*``, is in the sentence); a knob that needs a warp-tile
    # program (stages, warps, split, slices, wgmma, fast_math) refused for want of one, likewise
    "wmma.states": "GEMM + epilogue: the plan has other than one running state",
    "wmma.not_sum": "GEMM + epilogue: the state is not a two-operand sum over the serial dim",
    "wmma.not_product": "GEMM + epilogue: the state's body is not the product of its operands",
    "wmma.operand": "GEMM + epilogue: an operand is not a float16 input",
    "wmma.epilogue": "GEMM + epilogue: another op is not an element-wise epilogue",
    "wmma.gather": "GEMM + epilogue: an op gathers through an index expression",
    "wmma.second_pass": "GEMM + epilogue: outputs keep the serial dim",
    "warp_tile.second_pass": "outputs keep the serial dim (a second pass): no warp-tile program (per graph)",
    "warp_tile.dtype": "an input is not fp16/bf16 (per graph)",
    "warp_tile.mixed_dtypes": "the inputs mix dtypes (per graph)",
    "warp_tile.no_gemm_state": "no state is a GEMM over the serial dim: nothing for tensor cores",
    "warp_tile.row_dim": "the block tiles other than one row dim (and a GEMM's column dim)",
    "warp_tile.row_tile": "the row tile is not a multiple of 16 (16-row MMA tiles)",
    "warp_tile.off_plane": "a streamed space is not on the (row, serial) plane of the block",
    "warp_tile.gather_unread": "a gathered view is not read by the states directly",
    "warp_tile.tile_input": "an input on the score plane is not [.., row, serial] with serial a multiple of 8",
    "warp_tile.column_dim": "a tiled dim is not a GEMM state's column dim",
    "warp_tile.output": "an output is not on the rows (and a GEMM state's column dim)",
    "warp_tile.step": "the step is not a multiple of 16 (the MMA k extent)",
    "warp_tile.warps": "the warps are not 1, 2, 4 or 8 dividing the row tile into 16-row tiles",
    "warp_tile.merge_carry": "split or slices where a GEMM state's carry is not a per-row factor",
    "warp_tile.score_gemm": "a streamed op reduces but is not the first, a two-operand sum over one dim",
    "warp_tile.score_gemm_body": "the streamed GEMM's body is not the product of its operands",
    "warp_tile.score_gemm_operands": "the streamed GEMM's operands are not inputs",
    "warp_tile.score_gemm_a": "the streamed GEMM's A is not [.., row, K] with K last",
    "warp_tile.score_gemm_b": "the streamed GEMM's B is not on (serial, K) ending in either",
    "warp_tile.k_not_multiple": "the streamed GEMM's K is not a multiple of 8",
    "warp_tile.serial_not_multiple": "the serial dim is not a multiple of 8 where B ends in it",
    "warp_tile.k_padding": "K is not a multiple of 16 and B has it as rows (no zero rows padded in)",
    "warp_tile.gemm_state_sum": "a state off the rows is not a sum accumulator of its space",
    "warp_tile.gemm_state_dims": "a GEMM state is not [.., row, N] with one column dim N last",
    "warp_tile.gemm_state_body": "a GEMM state's body is not (input over N) * factor",
    "warp_tile.gemm_state_factor": "a GEMM state's factor depends on its column dim",
    "warp_tile.gemm_state_operand": "a GEMM state's operand is not [.., serial, .., N] with N last",
    "warp_tile.gemm_columns": "a GEMM state's columns per block are not a multiple of 16",
    "warp_tile.wgmma_warps": "wgmma with other than one or two warpgroups (4 or 8 warps)",
    "warp_tile.target": "the target has no mma.sync m16n8k16 (before sm_80: a V100 has WMMA only)",
    "warp_tile.wgmma_split": "wgmma with warp groups splitting the steps (split > 1)",
    "warp_tile.wgmma_early_scores": "wgmma with early_scores",
    "warp_tile.wgmma_columns": "wgmma with columns per block not a multiple of 64 (16) up to 256",
    "warp_tile.wgmma_operand": "wgmma's plain GEMM whose state is not a staged input times B with no carry",
    "warp_tile.wgmma_shared_a": "wgmma's GEMM states sharing A with other column dims or tiles",
    "warp_tile.wgmma_step": "wgmma's plain GEMM with a step other than 64 or not dividing the serial dim",
    "warp_tile.wgmma_form": "wgmma on a program that is neither a plain GEMM nor has its factor in registers",
    "warp_tile.wgmma_score_gemm": "wgmma's score GEMM with B not K-contiguous or a step not a multiple of 8",
    "gather.not_view": "a streamed op gathers but is not a view of one input",
    "gather.off_plane": "a gathered view is not on (row, serial) with serial last",
    "gather.chunk_width": "a gathered input's last dim is not a multiple of 8 (16-byte chunks)",
    "gather.chunk_outer": "a gathered view's outer index changes within a chunk",
    "gather.chunk_last": "a gathered view's last index depends on more than the serial dim",
    "gather.chunk_runs": "a gathered view's last index does not run over aligned runs of 8",
    # -- resources of one block on the hardware model (schedulers.resources.check_resources)
    "resource.shared_memory": "the block's shared memory is over the hardware model's limit",
    "resource.threads": "the block's threads are over the hardware model's limit",
    "resource.registers": "the block's registers are over the hardware model's limit",
    "resource.sm": "one block does not fit on an SM",
    "hardware": "a hardware model is malformed, unknown, or lacks the number asked for",
    "hardware.type": "hw is neither a HardwareModel nor a preset name",
    # -- the lowering's late checks (spacefusion.lower): a safety net behind the checks above
    "build.kernels": "a lowering gave other than one kernel",
    "build.shared_memory": "the built kernel's shared memory is over the target's limit",
    "build.threads": "the built kernel's threads are over the target's limit",
    "build.grid": "more blocks than a CUDA grid's x dimension holds",
    "lower.wmma_tensorizer": "TVM's tensorizer refuses the GEMM (shapes must be multiples of 16)",
    "lower.mma_read": "the warp-tile lowering cannot read a name where the program uses it",
    "lower.recompute_read": "a recomputed intermediate is read through an index the lowering cannot follow",
}


@functools.cache
def knob_refusals() -> dict[str, str]:
    """``<knob>.<reason>`` -> what it refuses, for every reason a knob's declaration lists (``knob(refusals=)``)."""
    from schedulers.options import KNOB_FIELDS

    return {f"{f.name}.{why}": text for f in KNOB_FIELDS for why, text in f.metadata["refusals"].items()}


def known(code: str) -> bool:
    """Whether ``code`` is in the table: one of ``REFUSALS``, a reason a knob declares (``knob_refusals``), or
    ``<knob>.<suffix>`` for a knob of the option groups and a suffix of ``KNOB_SUFFIXES``."""
    if code in REFUSALS or code in knob_refusals():
        return True
    from schedulers.options import KNOB_GROUP

    knob, _, suffix = code.rpartition(".")
    return knob in KNOB_GROUP and suffix in KNOB_SUFFIXES


def meaning(code: str) -> str:
    """What ``code`` refuses (KeyError naming the table for a code not in it)."""
    declared = REFUSALS | knob_refusals()
    if code in declared:
        return declared[code]
    if known(code):
        knob, _, suffix = code.rpartition(".")
        return f"{knob}: {KNOB_SUFFIXES[suffix]}"
    raise KeyError(f"refusal code {code!r} is not in schedulers.codes.REFUSALS nor declared by a knob")
