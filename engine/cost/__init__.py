"""Cost models: roofline, fitted measured model, utility formulas, synthetic router, profiling."""
