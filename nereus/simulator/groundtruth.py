"""Compatibility name for the controller tests' world: ``GroundTruth`` here is ``ModelWorld``
(``model_world.py``: the planner's cost model with other coefficients, a controlled world for
controller unit tests). The simulator's ground truth is ``nereus.simulator.truth.machine.GroundTruth``,
which shares no code with the cost model."""
from nereus.simulator.model_world import TRUE_PARAMS, ModelWorld
from nereus.simulator.truth.machine import Observation

GroundTruth = ModelWorld

__all__ = ["GroundTruth", "ModelWorld", "Observation", "TRUE_PARAMS"]
