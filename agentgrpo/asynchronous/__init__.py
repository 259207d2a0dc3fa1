"""Async GRPO: a producer plays rounds while the learner trains; its buffer, queue, weights."""
