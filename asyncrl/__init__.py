"""asyncrl: asynchronous actor-learner RL for language models."""

__version__ = "0.1.0"
