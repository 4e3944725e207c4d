"""sdzero's performance tuning advisor: trials, collectives benchmark, models, recommendations."""
