"""A round: its rows, scoring episodes as they end, the pipeline to a training batch."""
