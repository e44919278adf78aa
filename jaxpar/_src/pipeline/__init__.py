"""Pipeline parallelism in one SPMD program (MindSpore's ``pipeline_stages``, ``PipelineCell``).

The pieces, in the order a pipelined loss goes through them::

    config.py    PipelineConfig: stages, micro-batches, schedule, interleave (context + arguments)
    markers.py   jaxpar.pipeline_stage(i): optional stage markers in the user's forward
    layers.py    the layer sequence of a traced loss: marked regions, or repeated layers found
    split.py     how many layers each stage runs: balance the cost model's time, fit memory
    schedule.py  GPipe / circular / 1F1B as tick tables, their simulated timeline
    slots.py     buffer slots for activations, cotangents and residuals between ticks
    pieces.py    one chunk of layers, the prologue and the epilogue, replayed from the graph
    groups.py    the chunks per data-parallel row group: weight gradients reduced once a step
    ends.py      the prologue and epilogue per row group: their gradients reduced once a step
    loop.py      the tick loop inside shard_map: forward, backward (jax.vjp), ppermute
    residuals.py which leaves of a chunk's pullback the loop stores, recomputes or takes live
    memory.py    what the loop holds per device: slots, accumulators, one tick (plan.memory_bytes)
    residual_choice.py  pipeline_residuals="auto": store or recompute, by the memory budget
    arrays.py    the loop's slot buffers and gradient helpers
    program.py   everything above for one signature: the PipelineProgram
    tracing.py   what a parallelize call tells the PipelineCells it traces
    cell.py      PipelineCell: the custom_vjp loss a train step differentiates
    stacked.py   StackedParams: layer weights kept stacked by stage, split over "pp"
    outer.py     how the enclosing parallelize plans the pipeline's shard_map
    report.py    PipelinePlan: plan.pipeline, its explanation and timeline
"""
