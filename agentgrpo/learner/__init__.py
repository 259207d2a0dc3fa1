"""The learner's maths: advantages, losses, per-token weights, logprobs and the training batch.

Pure functions of tensors (and the `TrainingBatch` they share), tested against numbers worked
out by hand. This package imports only torch, the standard library and `rollout.types`; the
layer test enforces it.
"""
