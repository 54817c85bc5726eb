"""Runtime: the Engine and its steppable session, RoundStats, footprint maths, the observation and policy I/O."""
