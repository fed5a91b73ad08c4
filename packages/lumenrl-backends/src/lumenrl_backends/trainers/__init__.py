"""Trainers: the synchronous RL trainer (GRPO, DAPO, PPO), split by concept.

``rollout`` (generation + dynamic sampling), ``scoring`` (rewards), ``update`` (advantages,
rollout correction, loss functions), ``sync`` (weights to the engine), ``checkpoint``
(atomic save / resume), ``data`` (train / held-out eval records and loaders), ``evaluation``,
``metrics``, ``outputs`` (run record), ``build`` (parts from a RunPlan) and ``loop`` (``RLTrainer``).
"""

from lumenrl_backends.trainers.loop import RLTrainer

__all__ = ["RLTrainer"]
