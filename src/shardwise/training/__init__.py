"""What every application's training shares: the loop (``loop.run_loop`` over a
``TrainTask``), the warm-up + cosine LR schedule (``schedule``), ``metrics.jsonl`` and the
loss curve (``metrics``), and run directories (``rundir``: lock, resume, fresh)."""
