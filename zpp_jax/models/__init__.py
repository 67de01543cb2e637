"""Reference models built on the engine."""
