"""The parallel techniques, one package each: data_parallel (our DDP), zero (ZeRO-1/2/3),
tensor_parallel (Megatron column/row parallel, SP), pipeline (schedules as data, the
executor), context (ring attention over a sequence split across cp ranks), and precision
(mixed precision, loss scaling, the one global gradient norm)."""
