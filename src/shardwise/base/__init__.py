"""Layer 0: errors, the run configuration, the rank topology and the fork server's quick exit;
imports nothing of ours."""
