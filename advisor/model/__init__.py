"""Models fitted to measurements: alpha-beta links, memory, step time, prediction, search, recommendation, error."""
