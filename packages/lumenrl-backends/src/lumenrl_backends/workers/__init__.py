"""Rank-local workers for the controller path: actor, reference, critic and reward."""

from lumenrl_backends.workers.reward import RewardWorker, place_scores
from lumenrl_backends.workers.training import ActorWorker, CriticWorker, RefWorker

__all__ = ["ActorWorker", "CriticWorker", "RefWorker", "RewardWorker", "place_scores"]
