"""The GRPO trainer and its TRL face, its loss step and checkpoints, TRL arguments ported."""
