"""What a run shows: round metrics, the run's logs and chart, episode records, evaluation."""
