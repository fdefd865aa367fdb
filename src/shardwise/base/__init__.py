"""Layer 0: errors, the run configuration and the rank topology; imports nothing of ours."""
