"""Layout planning: which parallel layout of a cluster fits the model and trains fastest (`polytrain plan`).

    from polytrain.plan import Cluster, device_spec, plan
    estimates = plan(cfg, Cluster(device_spec("H100"), devices=64, nodes=8))
    estimates[0].layout.config_keys(), estimates[0].memory_gb, estimates[0].time.total

Reads the config and the model (built on the meta device) and the project's start-up
checks; never the trainer. devices.py (the hardware), shapes.py (parameters per unit),
layouts.py (what to try), activations.py and memory.py (peak memory per rank),
step_time.py (seconds per step), planner.py (ranking), report.py (output).
"""

from polytrain.plan.devices import Cluster, Device, device_spec, with_overrides
from polytrain.plan.layouts import Layout, SearchSpace
from polytrain.plan.planner import Estimate, evaluate, plan
from polytrain.plan.shapes import model_shape

__all__ = ["Cluster", "Device", "Estimate", "Layout", "SearchSpace", "device_spec", "evaluate", "model_shape",
           "plan", "with_overrides"]
