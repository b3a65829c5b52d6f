"""Tools an agent calls, run out of process: a deadline, a memory limit, no credentials."""
