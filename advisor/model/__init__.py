"""The performance model and its error bars: links, memory, step time, predictions, held-out errors,
intervals. Nothing here chooses a config (advisor.decide does)."""
