"""The maths of speculation: SpecConfig, sampling, draft trees, exact verification. Imports nothing above it."""
