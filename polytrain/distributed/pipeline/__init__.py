"""Pipeline parallelism: the model's modules split into stages on the ranks of the mesh's pp axis.

    plan = plan_from_config(cfg, dp)                 # stages, placement, micro-batches (validated)
    stages = split_model(meta_model, plan, pp_rank)  # this rank's pruned copies, global names
    ... tensor parallel, activation checkpointing, data parallel, materialize each stage ...
    runner = PipelineRunner(plan, stages, pp_rank, pp_group, device, ...)
    loss = runner.train_step(micro_batches, data, loss_fn)

plan.py decides, stages.py builds the stage modules and torch PipelineStages,
runner.py drives torch.distributed.pipelining's schedules, chunks.py gives each
stage its own data-parallel strategy behind the trainer's one interface, tied.py
keeps a tied embedding and its head copy equal across the first and last stage.
"""

from polytrain.distributed.pipeline.plan import PipelinePlan, plan_from_config
from polytrain.distributed.pipeline.runner import PipelineRunner
from polytrain.distributed.pipeline.stages import run_under, split_model

__all__ = ["PipelinePlan", "PipelineRunner", "plan_from_config", "run_under", "split_model"]
