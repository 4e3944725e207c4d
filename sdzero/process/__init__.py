"""Process life: distributed start-up, preemption signals, child process trees, a fast exit."""
